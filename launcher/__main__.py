"""`python -m launcher`: run the supervisor (see `launcher.supervisor`)."""

from launcher.supervisor import main

raise SystemExit(main())
