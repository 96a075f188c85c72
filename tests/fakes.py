"""Strict test doubles for slime's own classes: a fake has only what the real object has.

A bare `unittest.mock.Mock()` accepts any method, so a test can pass while the product calls a method the
real class never had. These fakes are built from the real class instead:

- `fake_actor_handle(cls, **behaviours)`: a Ray actor handle of `cls` (a `@ray.remote` class, or the plain
  class a handle is made from). It exposes exactly the public methods of the real class (for a Ray actor
  class, `cls.__ray_metadata__.modified_class`); `handle.method.remote(*args, **kwargs)` checks the
  arguments against the real method's signature, records the call and returns the behaviour's result.
  Calling `handle.method(...)` without `.remote` fails, as it does on a real handle.
- `fake_object(cls, **behaviours)`: a plain object of `cls`. Its public methods are called directly (and
  checked and recorded the same way); its public data attributes (class attributes, dataclass fields,
  annotations, properties and the `self.<name>` attributes the class's own code assigns) hold the values
  given as behaviours and may be set later; reading one that was not given raises AttributeError.
- `local_actor_handle(instance)`: a handle over a real in-process object; every public method of its class
  delegates to `instance` (for tests that run an actor's class without Ray).

A behaviour is a callable (called with the call's arguments: its result is returned, its exception raised)
or any other value (returned as is). A method without one returns None; set or replace one later with
`fake.method.behaviour = ...`. Naming a method the real class lacks, in a behaviour or as an attribute,
raises AttributeError naming the class.

Every call is recorded as `Call(name, args, kwargs)`, in order: on the method (`fake.method.calls`, name =
the method) and on the fake (`fake.calls`). To check the order of calls across several fakes, pass a shared
list and a label, positionally after the class: `fake_actor_handle(Manager, log, "manager", generate=...)`
appends `Call("manager.generate", args, kwargs)` to `log` as well. (They are positional-only, so they never
clash with a method of the same name.)

`.remote` returns the result itself, not an ObjectRef: tests using handles patch `ray.get` to return its
argument, as Ray's local mode would.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from typing import Any, NamedTuple

__all__ = ["Call", "fake_actor_handle", "fake_object", "local_actor_handle", "public_methods", "real_class"]


class Call(NamedTuple):
    name: str
    args: tuple
    kwargs: dict


def real_class(cls: Any) -> type:
    """The Python class whose methods a handle of `cls` exposes (Ray's modified class for an actor class)."""
    metadata = getattr(cls, "__ray_metadata__", None)
    modified = getattr(metadata, "modified_class", None)
    if modified is not None:
        return modified
    if not isinstance(cls, type):
        raise TypeError(f"expected a class or a Ray actor class, got {cls!r}")
    return cls


def _class_name(cls: type) -> str:
    """The name the user wrote (Ray's modified class is a local `Class` subclass of the original)."""
    original = cls.__dict__.get("__ray_actor_class__") or getattr(cls, "__ray_actor_class__", None)
    return (original or cls).__name__


def _signature(function: Any, drop_first: bool) -> inspect.Signature | None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without a signature: cannot check its calls
        return None
    parameters = list(signature.parameters.values())[1 if drop_first else 0 :]
    # Ray's modified actor class adds a tracing keyword to every method; callers never pass it.
    return signature.replace(parameters=[p for p in parameters if p.name != "_ray_trace_ctx"])


def public_methods(cls: Any) -> dict[str, inspect.Signature | None]:
    """Public methods of the real class of `cls` -> their signatures as callers see them (no self/cls)."""
    cls = real_class(cls)
    methods = {}
    for name in dir(cls):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, staticmethod):
            methods[name] = _signature(raw.__func__, drop_first=False)
        elif isinstance(raw, classmethod):
            methods[name] = _signature(raw.__func__, drop_first=True)
        elif inspect.isfunction(raw):
            methods[name] = _signature(raw, drop_first=True)
        elif callable(raw) and not isinstance(raw, type) and inspect.isroutine(raw):
            methods[name] = None
    return methods


def _assigned_attributes(klass: type) -> set[str]:
    """`self.<name>` attributes that the source of `klass` assigns (in any method)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return set()
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    }


def public_attributes(cls: Any) -> set[str]:
    """Public data attributes an instance of the real class of `cls` has (see the module docstring)."""
    cls = real_class(cls)
    methods = public_methods(cls)
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object:
            continue
        names |= {name for name, value in vars(klass).items() if name not in methods}
        names |= set(inspect.get_annotations(klass))
        slots = vars(klass).get("__slots__", ())
        names |= {slots} if isinstance(slots, str) else set(slots)
        names |= _assigned_attributes(klass)
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls)}
    return {name for name in names if not name.startswith("_") and name not in methods}


class _Recorder:
    """What one fake method shares with its fake: the class, the signature and where calls are recorded."""

    def __init__(self, owner: _FakeBase, name: str, signature: inspect.Signature | None, behaviour: Any) -> None:
        self._owner = owner
        self.name = name
        self.signature = signature
        self.behaviour = behaviour
        self.calls: list[Call] = []

    def _invoke(self, args: tuple, kwargs: dict) -> Any:
        state = object.__getattribute__(self._owner, "_fake_state")
        if self.signature is not None:
            try:
                self.signature.bind(*args, **kwargs)
            except TypeError as error:
                raise TypeError(f"{state.class_name}.{self.name}{self.signature}: {error}") from None
        call = Call(self.name, args, dict(kwargs))
        self.calls.append(call)
        state.calls.append(call)
        if state.log is not None:
            label = f"{state.label}.{self.name}" if state.label else self.name
            state.log.append(Call(label, args, dict(kwargs)))
        behaviour = self.behaviour
        return behaviour(*args, **kwargs) if callable(behaviour) else behaviour

    def __repr__(self) -> str:
        state = object.__getattribute__(self._owner, "_fake_state")
        return f"<fake {state.class_name}.{self.name}>"


class _RemoteMethod(_Recorder):
    """One actor method of a fake handle: call it with `.remote(...)`."""

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self._invoke(args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = object.__getattribute__(self._owner, "_fake_state")
        raise TypeError(
            f"Actor methods cannot be called directly: use .{self.name}.remote(...) on the "
            f"{state.class_name} handle, not .{self.name}(...)"
        )


class _Method(_Recorder):
    """One method of a fake plain object: call it directly."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._invoke(args, kwargs)


class _State:
    def __init__(self, cls: type, kind: str, log: list | None, label: str | None, attributes: set[str]) -> None:
        self.cls = cls
        self.class_name = _class_name(cls)
        self.kind = kind
        self.log = log
        self.label = label
        self.attributes = attributes
        self.calls: list[Call] = []


class _FakeBase:
    """Attribute access limited to the real class's public members; everything else is an AttributeError."""

    _fake_state: _State

    def __init__(self, state: _State, methods: dict[str, _Recorder]) -> None:
        object.__setattr__(self, "_fake_state", state)
        if "calls" not in methods and "calls" not in state.attributes:
            object.__setattr__(self, "calls", state.calls)
        for name, method in methods.items():
            object.__setattr__(self, name, method)

    def __getattr__(self, name: str) -> Any:
        state = object.__getattribute__(self, "_fake_state")
        if name in state.attributes:
            raise AttributeError(
                f"fake {state.class_name}: attribute {name!r} was not given (fake_object(..., {name}=...))"
            )
        what = "public method" if state.kind == "actor handle" else "public method or attribute"
        raise AttributeError(f"{state.class_name} has no {what} {name!r} (a fake {state.kind} of {state.class_name})")

    def __setattr__(self, name: str, value: Any) -> None:
        state = object.__getattribute__(self, "_fake_state")
        if name in state.attributes:
            object.__setattr__(self, name, value)
            return
        existing = self.__dict__.get(name)
        if isinstance(existing, _Recorder):
            raise AttributeError(
                f"{state.class_name}.{name} is a method of the fake; set fake.{name}.behaviour instead of replacing it"
            )
        raise AttributeError(f"{state.class_name} has no public attribute {name!r} (a fake {state.kind})")

    def __delattr__(self, name: str) -> None:
        state = object.__getattribute__(self, "_fake_state")
        raise AttributeError(f"cannot delete {name!r} from a fake {state.kind} of {state.class_name}")

    def __repr__(self) -> str:
        state = object.__getattribute__(self, "_fake_state")
        label = f" {state.label!r}" if state.label else ""
        return f"<fake {state.kind} of {state.class_name}{label}>"


class FakeActorHandle(_FakeBase):
    """See `fake_actor_handle`."""


class FakeObject(_FakeBase):
    """See `fake_object`."""


def _unknown(class_name: str, names: list[str], what: str) -> AttributeError:
    listed = ", ".join(repr(name) for name in names)
    return AttributeError(f"{class_name} has no {what} {listed}; a fake has only what the real class has")


def fake_actor_handle(cls: Any, log: list | None = None, label: str | None = None, /, **behaviours: Any) -> Any:
    """A fake Ray actor handle of `cls` exposing exactly its public methods (see the module docstring)."""
    real = real_class(cls)
    methods = public_methods(real)
    state = _State(real, "actor handle", log, label, set())
    unknown = sorted(set(behaviours) - set(methods))
    if unknown:
        raise _unknown(state.class_name, unknown, "public method")
    handle = FakeActorHandle.__new__(FakeActorHandle)
    recorders = {name: _RemoteMethod(handle, name, sig, behaviours.get(name)) for name, sig in methods.items()}
    _FakeBase.__init__(handle, state, recorders)
    return handle


def fake_object(cls: Any, log: list | None = None, label: str | None = None, /, **behaviours: Any) -> Any:
    """A fake plain object of `cls`: its public methods and data attributes only (see the module docstring)."""
    real = real_class(cls)
    methods = public_methods(real)
    attributes = public_attributes(real)
    state = _State(real, "object", log, label, attributes)
    unknown = sorted(set(behaviours) - set(methods) - attributes)
    if unknown:
        raise _unknown(state.class_name, unknown, "public method or attribute")
    fake = FakeObject.__new__(FakeObject)
    recorders = {name: _Method(fake, name, sig, behaviours.get(name)) for name, sig in methods.items()}
    _FakeBase.__init__(fake, state, recorders)
    for name in attributes & set(behaviours):
        object.__setattr__(fake, name, behaviours[name])
    return fake


def local_actor_handle(instance: Any, log: list | None = None, label: str | None = None, /) -> Any:
    """A handle whose every public method runs on `instance`, a real object of the actor's class."""
    methods = public_methods(type(instance))
    return fake_actor_handle(type(instance), log, label, **{name: getattr(instance, name) for name in methods})
