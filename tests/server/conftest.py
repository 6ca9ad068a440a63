import pytest
from daemon_proc import Daemon, start


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Daemon:
    d = start(tmp_path_factory.mktemp("blockd"))
    yield d
    d.stop()
