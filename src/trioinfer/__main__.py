"""``python -m trioinfer``: the same command line as the ``trioinfer`` console script."""

from .cli import main

if __name__ == "__main__":
    main()
