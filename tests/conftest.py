import sys
from pathlib import Path
from typing import Any

import pytest

# Test helpers (distributed.py, models.py) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> list:
    """What ``varuna-launch``'s main() would run: the LaunchConfigs it hands to ``launch``
    (nothing is started)."""
    import varuna.launch.launcher

    configs: list = []

    def fake_launch(config, progress: bool = False) -> int:
        configs.append(config)
        return 0

    monkeypatch.setattr(varuna.launch.launcher, "launch", fake_launch)
    return configs


@pytest.fixture
def autoconfig_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The keyword arguments of every ``simulator.autoconfig.autoconfigure`` call (it still runs)."""
    import simulator.autoconfig

    seen: list[dict[str, Any]] = []
    real = simulator.autoconfig.autoconfigure

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(simulator.autoconfig, "autoconfigure", spy)
    return seen
