"""The rollout controller: pools, deadlines, retries and backends for environments."""
