"""``python -m envport``: the ``envport`` command, for environments without its script."""

from envport.cli import app

if __name__ == "__main__":
    app(prog_name="envport")
