import sys

from commitgate.server.cli.main import main

sys.exit(main())
