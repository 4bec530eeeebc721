"""``python -m seedancectl.cli``."""

from seedancectl.cli import main

main()
