"""Plain `pytest` runs the fast tests; `pytest --all` adds those marked slow (learning CartPole,
the whole stop and signal matrix, Pong and torchrun runs, play and plot on a trained run)."""


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", help="run the slow tests too")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of plain pytest; `pytest --all` runs it")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--all"):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
