import sys

from tetrad.cli.main import main

sys.exit(main())
