"""`python -m controlplane.cli` runs `dctl`."""

from controlplane.cli.app import main

main()
