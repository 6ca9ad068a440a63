import sys
from pathlib import Path

# The daemon launcher is shared with the server tests, the pool workers with the pool tests.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pools"))
