"""``python -m envport.gateway``: see :func:`envport.gateway.serve.main`."""

from envport.gateway.serve import main

if __name__ == "__main__":
    main()
