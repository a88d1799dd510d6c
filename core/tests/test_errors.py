"""Every public exception the core defines derives from ``AitrainsaiError`` and keeps its builtin base."""

import importlib
import inspect
import pkgutil

import aitrainsai
from aitrainsai import AitrainsaiError
from aitrainsai.stopping import Interrupted


def core_exceptions() -> list[type[BaseException]]:
    found = []
    for info in pkgutil.walk_packages(aitrainsai.__path__, "aitrainsai."):
        if info.name.endswith("__main__"):  # the command line: importing it runs it
            continue
        try:
            module = importlib.import_module(info.name)
        except ModuleNotFoundError:  # a module of an extra that is not installed
            continue
        found += [obj for name, obj in vars(module).items() if inspect.isclass(obj) and issubclass(obj, BaseException)
                  and obj.__module__ == info.name and not name.startswith("_")]
    return found


def test_every_core_exception_derives_from_the_base():
    exceptions = core_exceptions()
    assert len(exceptions) > 20
    # a KeyboardInterrupt on purpose: outside Exception, so that ``except Exception`` does not swallow a stop
    assert [e.__name__ for e in exceptions if not issubclass(e, AitrainsaiError)] == [Interrupted.__name__]


def test_an_exception_keeps_its_builtin_base():
    from aitrainsai import ConfigError, SpecError, UntrustedInputError, WheelError

    assert issubclass(UntrustedInputError, ValueError) and issubclass(SpecError, ValueError)
    assert issubclass(WheelError, RuntimeError) and issubclass(ConfigError, AitrainsaiError)
    error = UntrustedInputError("a message", "not JSON")
    assert isinstance(error, ValueError) and isinstance(error, AitrainsaiError)
