import sys

from bench.profile.run import main

sys.exit(main())
