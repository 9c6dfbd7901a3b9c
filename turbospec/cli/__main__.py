import sys

from turbospec.cli.main import main

sys.exit(main())
