"""Finding user code by name or ``module:attribute``: one :class:`Registry` serves
policies, tasks, optimizers and lr schedulers."""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from importlib.metadata import entry_points
from typing import Any, Generic, TypeVar

from paramserver.errors import RegistryError

__all__ = ["Registry", "import_object", "load_entry_points", "names_from", "register_subclass",
           "subclass_check"]

log = logging.getLogger(__name__)
_loaded: set[str] = set()
#: where the names resolved now were read, when not from the user (see names_from)
_foreign: ContextVar[tuple[str, str, frozenset[str]] | None] = ContextVar(
    "paramserver_foreign_names", default=None)


@contextlib.contextmanager
def names_from(source: str, *, trusted: bool = False, allow: Iterable[str | None] = (),
               hint: str = "pass --trust-plugins if you trust it") -> Iterator[None]:
    """Resolve, inside, names read from ``source`` (a trace, a run's configs, a
    checkpoint: files anyone may have written or changed) rather than given by the user:
    a ``module:attr`` among them would import and run that module's code, so unless
    ``trusted`` it is refused (RegistryError, naming ``source`` and ``hint``). Built-in
    and installed (entry point) names resolve as usual, and so do the ``allow`` ones
    (those the user gave on the command line beside the file)."""
    allowed = frozenset(a.strip() for a in allow if a)
    token = _foreign.set(None if trusted else (source, hint, allowed))
    try:
        yield
    finally:
        _foreign.reset(token)


def import_object(spec: str) -> Any:
    """Import ``module:attr`` (``attr`` may be dotted); RegistryError says what failed."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise RegistryError(f"{spec!r} must look like module:name")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise RegistryError(f"cannot import module {module_name!r} from {spec!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed as it ran: one line, not a trace
        raise RegistryError(f"importing module {module_name!r} from {spec!r} failed: "
                            f"{type(exc).__name__}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise RegistryError(f"module {module_name!r} has no attribute {attr!r}") from exc
    return obj


def load_entry_points(group: str, register: Callable[[str, Any], object], what: str) -> None:
    """Load each installed entry point of ``group`` once per process, handing
    ``(name, object)`` to ``register``; a broken plug-in is logged, not fatal,
    so that it cannot hide the others."""
    if group in _loaded:
        return
    _loaded.add(group)
    for ep in entry_points(group=group):
        try:
            obj = ep.load()
        except Exception as exc:
            log.warning("%s entry point %r (%s) failed to load: %s", what, ep.name, ep.value, exc)
            continue
        register(ep.name, obj)


T = TypeVar("T")
B = TypeVar("B")


def subclass_check(base: type[B]) -> Callable[[Any, str], type[B]]:
    """A registry's ``check`` for plug-in classes of ``base`` with a ``name``: refuses
    anything else; a class filed under another name (an entry point's) is given that
    name, in a subclass of its own, so that ``cls.name`` is what it was found by."""
    def check(obj: Any, name: str) -> type[B]:
        if not (isinstance(obj, type) and issubclass(obj, base)):
            raise RegistryError(f"{name if ':' in name else obj!r} is not a "
                                f"{base.__name__} subclass")
        if ":" not in name and getattr(obj, "name", "") != name:
            # an entry point's name wins over the class's own
            obj = type(obj.__name__, (obj,), {"name": name, "__module__": obj.__module__})
        return obj

    return check


def register_subclass(registry: Registry[type[B]], base: type[B], cls: type[B]) -> type[B]:
    """File ``cls`` under ``cls.name`` in ``registry``, refusing a class not of ``base``
    or without a name (the body of register_policy and register_compressor)."""
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise RegistryError(f"{cls!r} is not a {base.__name__} subclass")
    name = getattr(cls, "name", "")
    if not name:
        raise RegistryError(f"{cls.__qualname__} has no `name`")
    registry.register(name, cls)
    return cls


def _qualname(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


class Registry(Generic[T]):
    """Named plug-ins of one kind: policies, tasks, optimizers, lr schedulers.

    ``register(name, obj)`` files an object under a checked name (non-empty, no
    spaces at the ends, no ``:``, which means ``module:attr``), refusing a name
    taken by another object; ``resolve(name)`` finds a registered name (after
    loading the installed entry points of ``group``), a name ``fallback`` knows,
    or ``module:attr``; ``available()`` lists the registered ones. ``check``
    refuses an object of the wrong kind with RegistryError. Names are compared
    after ``normalize`` (e.g. lower-casing). ``store`` returns the dict the objects
    live in (default: the registry's own).
    """

    def __init__(self, what: str, *, group: str | None = None,
                 check: Callable[[Any, str], T] | None = None,
                 normalize: Callable[[str], str] = str,
                 fallback: Callable[[str], T | None] | None = None,
                 hint: str | Callable[[], str] = "or give module:name",
                 store: Callable[[], dict[str, T]] | None = None) -> None:
        self.what = what
        self.group = group
        self._check = check
        self._normalize = normalize
        self._fallback = fallback
        self._hint = hint
        own: dict[str, T] = {}
        #: where the objects live: our own dict, or a module's (which a test may swap)
        self._store = store if store is not None else (lambda: own)

    @property
    def _items(self) -> dict[str, T]:
        return self._store()

    def check_name(self, name: str) -> str:
        if not isinstance(name, str) or not name or ":" in name or name != name.strip():
            raise RegistryError(
                f"{self.what} name {name!r} is not allowed: it must be non-empty, without "
                "spaces at the ends, and without ':' (which means module:name)")
        return name

    def register(self, name: str, obj: Any) -> T:
        self.check_name(name)
        checked = self._check(obj, name) if self._check is not None else obj
        key = self._normalize(name)
        existing = self._items.get(key)
        # re-importing the defining module makes a new object for the same thing: no clash
        if existing is not None and existing is not checked \
                and _qualname(existing) != _qualname(checked):
            raise RegistryError(f"{self.what} name {name!r} is already registered by "
                                f"{_qualname(existing)}")
        self._items[key] = checked
        return checked

    def load_entry_points(self) -> None:
        if self.group:
            load_entry_points(self.group, self._register_entry_point, self.what)

    def _register_entry_point(self, name: str, obj: Any) -> None:
        try:
            self.register(name, obj)
        except RegistryError as exc:
            log.warning("%s entry point %r refused: %s", self.what, name, exc)

    def available(self) -> dict[str, T]:
        """Registered (built-in and installed) objects by name, sorted by name."""
        self.load_entry_points()
        return dict(sorted(self._items.items()))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._normalize(name) in self._items

    def get(self, name: str) -> T | None:
        """A registered name's object, or None (no entry points loaded, no fallback)."""
        return self._items.get(self._normalize(name))

    def resolve(self, name: str) -> T:
        """A registered name, a name ``fallback`` knows, or ``module:attr``."""
        if ":" in name:
            foreign = _foreign.get()
            if foreign is not None and name.strip() not in foreign[2]:
                raise RegistryError(f"{foreign[0]} names the {self.what} {name.strip()!r}, "
                                    f"code to import and run: not imported ({foreign[1]})")
            obj = import_object(name.strip())
            return self._check(obj, name) if self._check is not None else obj
        key = self._normalize(name)
        if key not in self._items:
            self.load_entry_points()
        if key in self._items:
            return self._items[key]
        found = self._fallback(name) if self._fallback is not None else None
        if found is not None:
            return found
        hint = self._hint() if callable(self._hint) else self._hint
        known = ", ".join(self.available()) or "none"
        raise RegistryError(f"unknown {self.what} {name!r}; known: {known} ({hint})")
