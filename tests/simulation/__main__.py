import sys

from tests.simulation.explore import main

sys.exit(main())
