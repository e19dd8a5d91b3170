"""`LossSpec`: a loss the resource knows, with its `InputSpec`s and `ParamSpec`s."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import resource_pb2

__all__ = ["LossSpec", "InputSpec", "ParamSpec"]


@dataclass(frozen=True)
class InputSpec:
    """One ``loss_fn_inputs`` key a loss takes: name, dtype ("int64"/"float32"), required."""

    name: str
    dtype: str
    required: bool
    description: str = ""


@dataclass(frozen=True)
class ParamSpec:
    """One loss parameter: name, type ("float"/"int"/"string"), required, default (text), choices."""

    name: str
    type: str
    required: bool
    default: str = ""
    choices: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True)
class LossSpec:
    """A loss the resource knows: its inputs, parameters, formula and whether it is served."""

    name: str
    inputs: tuple[InputSpec, ...]
    params: tuple[ParamSpec, ...]
    formula: str = ""
    available: bool = True

    @property
    def input_dtypes(self) -> dict[str, str]:
        """key -> "int64" | "float32"."""
        return {i.name: i.dtype for i in self.inputs}

    @classmethod
    def from_proto(cls, msg: resource_pb2.LossSpec) -> "LossSpec":
        return cls(
            name=msg.name,
            inputs=tuple(InputSpec(i.name, i.dtype, i.required, i.description) for i in msg.inputs),
            params=tuple(
                ParamSpec(p.name, p.type, p.required, p.default, tuple(p.choices), p.description) for p in msg.params
            ),
            formula=msg.formula,
            available=msg.available,
        )
