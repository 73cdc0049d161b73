"""`python -m switchyard.cli`, the same as `python -m switchyard`."""

from switchyard.cli import main

raise SystemExit(main())
