import sys

from aiak.cli.main import main

sys.exit(main())
