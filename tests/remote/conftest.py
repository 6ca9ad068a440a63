import sys
from pathlib import Path

# The daemon launcher and the pool workers are shared with the server and pool tests.
_TESTS = Path(__file__).resolve().parent.parent
for sub in ("server", "pools"):
    sys.path.insert(0, str(_TESTS / sub))
