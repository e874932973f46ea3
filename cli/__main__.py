"""`python -m cli` runs `dctl`."""

from cli.app import main

main()
