import sys

from prefixcache.entrypoints.cli.main import main

sys.exit(main())
