import sys

from longmoe.cli import main

sys.exit(main())
