"""MCP for envport environments.

* :mod:`envport.mcp.server`: ``MCPEndpoint``, a Streamable HTTP MCP server (official SDK)
  exposing one environment's tools, one envport session per MCP session.
* :mod:`envport.mcp.jsonrpc`: ``handle_jsonrpc``, the JSON-RPC 2.0 handler for OpenEnv's
  WebSocket ``{"type": "mcp"}`` frames.
* :mod:`envport.mcp.results`: the tool listing and call-result shapes both share.

Nothing is imported here, so ``import envport`` never loads the MCP SDK.
"""
