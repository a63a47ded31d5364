"""Every pydantic model is complete once its module is imported. A model with a forward
reference left open is built at its first use: in a work horse, forked per task from a worker
that never used it, that cost 7 ms on every task (the Checkpoint of every task record)."""

from __future__ import annotations

import importlib
import pkgutil
import sys

import pydantic


def test_every_model_is_built_at_import() -> None:
    for layer in ("config", "worker", "coordinator"):
        package = importlib.import_module(f"overnight.{layer}")
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if not info.name.endswith("__main__"):
                importlib.import_module(info.name)
    open_models = [
        f"{name}.{attr}"
        for name, module in list(sys.modules.items())
        if name.startswith("overnight.")
        for attr, obj in vars(module).items()
        if isinstance(obj, type)
        and issubclass(obj, pydantic.BaseModel)
        and obj.__module__ == name
        and not obj.__pydantic_complete__
    ]
    assert open_models == []
