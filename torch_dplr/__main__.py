import sys

from .selfcheck import main

sys.exit(main())
