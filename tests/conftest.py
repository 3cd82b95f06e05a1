import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Two cores: keep torch from oversubscribing when the suite runs beside other work.
os.environ.setdefault("OMP_NUM_THREADS", "2")
