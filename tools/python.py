"""`python = "package.module:function"`: a typed function, sync or async.

The input schema comes from the signature (pydantic); a parameter annotated
`OperationContext` is injected, never part of the schema. Sync functions run in
a worker thread so they cannot stall the event loop.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

import anyio.to_thread
from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from commitgate.server.model.context import OperationContext
from commitgate.server.model.records import ToolResult
from commitgate.server.model.validation import describe
from commitgate.server.policy.models import Policy, ToolPolicy
from commitgate.tools.base import Collaborators, InvalidArguments, SourceLoadError

# The bundled example tools once lived beside the tool sources; a policy written then names the old module.
MOVED_MODULES = {
    "commitgate.tools.demo": "commitgate.server.demo.tools",
    "commitgate.tools.sandbox_api": "commitgate.server.demo.payments_api",
    "commitgate.tools.benchtools": "commitgate.server.bench.tools",
}


def load_callable(ref: str) -> Callable[..., Any]:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise SourceLoadError(f"{ref!r} is not of the form 'package.module:function'")
    if module_name in MOVED_MODULES:
        moved = f"{MOVED_MODULES[module_name]}:{attr}"
        raise SourceLoadError(f"module {module_name!r} has moved: write {moved!r}")
    target: Any = _import(module_name)
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise SourceLoadError(f"module {module_name!r} has no attribute {attr!r}") from None
    if not callable(target):
        raise SourceLoadError(f"{ref!r} is not callable")
    return typing.cast(Callable[..., Any], target)


def _import(module_name: str) -> Any:
    """The module, or a SourceLoadError saying why not; its import may not end the process."""
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise SourceLoadError(f"cannot import module {module_name!r}: {exc}") from exc
    except SyntaxError as exc:
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else "its source"
        raise SourceLoadError(f"module {module_name!r} has a syntax error ({where}): {exc.msg}") from exc
    except SystemExit as exc:  # a script-style module: serving or checking must go on
        raise SourceLoadError(
            f"module {module_name!r} called sys.exit({exc.code!r}) while being imported;"
            " guard script code with `if __name__ == '__main__':`"
        ) from None
    except Exception as exc:
        raise SourceLoadError(f"importing module {module_name!r} raised {type(exc).__name__}: {exc}") from exc


def _is_context(annotation: Any) -> bool:
    if annotation is OperationContext:
        return True
    return OperationContext in typing.get_args(annotation)


class _Signature:
    """The parameters of a function, split into schema fields and the injected context."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        try:
            hints = typing.get_type_hints(fn, include_extras=True)  # Field(...) constraints too
        except Exception as exc:
            raise SourceLoadError(f"cannot resolve the type hints of {fn!r}: {exc}") from exc
        self.context_param: str | None = None
        fields: dict[str, Any] = {}
        for name, param in inspect.signature(fn).parameters.items():
            annotation = hints.get(name, Any)
            if _is_context(annotation):
                self.context_param = name
                continue
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise SourceLoadError(f"{fn.__qualname__}: *args/**kwargs cannot be described to a model")
            default = ... if param.default is inspect.Parameter.empty else param.default
            fields[name] = (annotation, default)
        self.names = tuple(fields)
        self.model: type[BaseModel] = create_model(
            f"{fn.__name__}_arguments", __config__=ConfigDict(extra="forbid"), **fields
        )
        # The model's own validator and serializer, taken once: `model_validate` and `model_dump`
        # check their options on every call, which cost a guarded call several times the work itself.
        self.parse: Callable[[Any], BaseModel] = self.model.__pydantic_validator__.validate_python
        self._serialize = self.model.__pydantic_serializer__.to_python

    def normalised(self, model: BaseModel) -> dict[str, Any]:
        """`model.model_dump(mode="json")`: the arguments as JSON values."""
        return typing.cast(dict[str, Any], self._serialize(model, mode="json"))


class PythonTool:
    """A ToolSource calling a typed Python function; its schema comes from the signature."""

    def __init__(self, name: str, policy: ToolPolicy, whole: Policy, using: Collaborators) -> None:
        assert policy.python is not None, "chosen by the source table for python entries"
        ref = policy.python
        status_ref = policy.status_check.python if policy.status_check else None
        description = policy.description
        self.ref = ref
        self.fn = load_callable(ref)
        self.signature = _Signature(self.fn)
        self.input_schema: dict[str, Any] = self.signature.model.model_json_schema()
        self.input_schema.pop("title", None)
        self.output_schema: dict[str, Any] | None = None
        doc = inspect.getdoc(self.fn) or ""
        self.description = description or doc.strip().split("\n\n")[0].replace("\n", " ") or ref
        try:
            self.status_fn = load_callable(status_ref) if status_ref else None
            self.has_status_check = self.status_fn is not None
            if self.status_fn is not None:
                self._check_status_signature(status_ref or "")
        except SourceLoadError as exc:
            exc.field = "status_check"
            raise

    def _check_status_signature(self, status_ref: str) -> None:
        status_signature = _Signature(typing.cast(Callable[..., Any], self.status_fn))
        if set(status_signature.names) != set(self.signature.names):
            raise SourceLoadError(
                f"status check {status_ref} takes ({', '.join(status_signature.names)}) but the tool takes "
                f"({', '.join(self.signature.names)}); a status check has the same parameters as its tool"
            )
        self._status_context = status_signature.context_param

    def validate(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            model = self.signature.parse(arguments)
        except ValidationError as exc:
            raise InvalidArguments(describe(exc)) from None
        return _Validated(self.signature.normalised(model), model)

    def _kwargs(
        self, arguments: dict[str, Any], ctx: OperationContext, context_param: str | None
    ) -> dict[str, Any]:
        model = arguments.take() if isinstance(arguments, _Validated) else None
        if model is None:
            model = self.signature.parse(arguments)
        kwargs = {name: getattr(model, name) for name in self.signature.names}
        if context_param is not None:
            kwargs[context_param] = ctx
        return kwargs

    async def call(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult:
        kwargs = self._kwargs(arguments, ctx, self.signature.context_param)
        return _to_result(await _invoke(self.fn, kwargs))

    async def status(self, arguments: dict[str, Any], ctx: OperationContext) -> ToolResult | None:
        if self.status_fn is None:
            raise RuntimeError(f"{self.ref} declares no status check")
        found = await _invoke(self.status_fn, self._kwargs(arguments, ctx, self._status_context))
        return None if found is None else _to_result(found)


class _Validated(dict[str, Any]):
    """Arguments as `validate` normalised them, holding the model they were validated into, so
    that the first attempt does not validate them again. The model goes to one attempt only: a
    tool may change what it was given, and a retry gets values of its own, validated afresh, as
    do arguments read back from the ledger (a status check after a restart)."""

    __slots__ = ("_model",)

    def __init__(self, normalised: dict[str, Any], model: BaseModel) -> None:
        super().__init__(normalised)
        self._model: BaseModel | None = model

    def take(self) -> BaseModel | None:
        model, self._model = self._model, None
        return model


async def _invoke(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(**kwargs)
    return await anyio.to_thread.run_sync(functools.partial(fn, **kwargs))


def _to_result(value: Any) -> ToolResult:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return ToolResult.of(value)
