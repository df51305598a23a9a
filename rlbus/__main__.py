"""`python -m rlbus` is the `rlbus` command."""

from rlbus.cli import main

main()
