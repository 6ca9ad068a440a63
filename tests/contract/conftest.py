"""Contract tests: blockd against the installed vLLM's own code (never a copy of it).

The daemon launcher is shared with the server tests. vLLM is imported once per module, by a
module-scoped fixture of the test file, and the tests skip with the reason when it is not
importable (``make install`` installs it: the ``vllm`` extra of pyproject.toml).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))
