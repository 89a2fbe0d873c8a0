"""AccelMagics: option parsing and glue between IPython and the probe, plan, accelerator and display."""

from __future__ import annotations

import keyword
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Enum, Int, TraitError, Unicode, validate

from .plan import MIXED_PRECISION, STRATEGIES, Plan, PlanError, Request, make_plan
from .runtime import probe

__all__ = ["AccelMagics"]


def _is_accelerator(obj: Any) -> bool:
    from .accelerator import LazyAccelerator

    cls = type(obj)
    return isinstance(obj, LazyAccelerator) or (
        cls.__name__ == "Accelerator" and cls.__module__.startswith("accelerate")
    )


def _positive_int(value: str | None, option: str) -> int | None:
    if value is None:
        return None
    text = value.strip()
    if not text.lstrip("+").isdigit() or int(text) < 1:
        raise UsageError(f"{option} must be a whole number of at least 1, not {value!r}.")
    return int(text)


def _choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
    if value is None:
        return None
    if value.lower() not in choices:
        raise UsageError(f"{option} must be one of {', '.join(choices)}, not {value!r}.")
    return value.lower()


def _parse(magic: Any, line: str, name: str) -> Any:
    try:
        return parse_argstring(magic, line)
    except UsageError as err:
        raise UsageError(f"%{name}: {str(err).rstrip('.')}; see %{name}? for the options.") from None


@magics_class
class AccelMagics(Magics):
    """Magics that probe the runtime, decide a plan and build a CPU-safe `accelerator`.

    Every option is also a trait, so `%config AccelMagics.num_processes = 2` sets a default.
    """

    num_processes = Int(None, allow_none=True, help="Processes (ranks) to run; default: 1 on CPU, one per GPU.").tag(
        config=True
    )
    cpu = Bool(False, help="Use the CPU even where a GPU or TPU is present (accelerate's `cpu`).").tag(config=True)
    mixed_precision = Enum(MIXED_PRECISION, None, allow_none=True, help="Mixed precision: no, fp16, bf16 or fp8.").tag(
        config=True
    )
    strategy = Enum(STRATEGIES, "ddp", help="Distributed strategy: ddp, fsdp or deepspeed.").tag(config=True)
    strict = Bool(False, help="Refuse instead of falling back when a request cannot be honoured.").tag(config=True)
    name = Unicode("accelerator", help="Name of the Accelerator variable in the notebook.").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any):
        super().__init__(shell=shell, **kwargs)
        self.plan: Plan | None = None

    @validate("num_processes")
    def _check_num_processes(self, proposal: Any) -> Any:
        if proposal.value is not None and proposal.value < 1:
            raise TraitError(f"num_processes must be at least 1, not {proposal.value}.")
        return proposal.value

    @validate("name")
    def _check_name(self, proposal: Any) -> Any:
        if not proposal.value.isidentifier() or keyword.iskeyword(proposal.value):
            raise TraitError(f"name must be a Python identifier, not {proposal.value!r}.")
        return proposal.value

    def _request(self, args: Any) -> Request:
        n = _positive_int(args.num_processes, "-n/--num-processes")
        return Request(
            num_processes=n if n is not None else self.num_processes,
            cpu=args.cpu or self.cpu,
            mixed_precision=_choice(args.mixed_precision, MIXED_PRECISION, "--mixed-precision") or self.mixed_precision,
            strategy=_choice(args.strategy, STRATEGIES, "--strategy") or self.strategy,
            strict=args.strict or self.strict,
        )

    def _target_name(self, args: Any) -> str:
        name = args.name if args.name is not None else self.name
        if not name.isidentifier() or keyword.iskeyword(name):
            raise UsageError(f"--name must be a Python identifier such as accelerator, not {name!r}.")
        existing = self.shell.user_ns.get(name)
        if existing is not None and not args.force and not _is_accelerator(existing):
            kind = type(existing).__name__
            raise UsageError(f"`{name}` already holds a {kind}: pass --force to replace it, or choose another --name.")
        return name

    @magic_arguments()
    @argument("-n", "--num-processes", metavar="N", help="processes (ranks); default: 1 on CPU, one per GPU")
    @argument("--cpu", action="store_true", help="use the CPU even where a GPU or TPU is present")
    @argument("--mixed-precision", metavar="P", help="no, fp16, bf16 or fp8")
    @argument("--strategy", metavar="S", help="ddp, fsdp or deepspeed")
    @argument("--strict", action="store_true", help="refuse instead of falling back")
    @argument("--name", metavar="NAME", help="variable for the Accelerator (default: accelerator)")
    @argument("--force", action="store_true", help="replace a variable of that name that is not an Accelerator")
    @argument("--quiet", action="store_true", help="do not show the panel")
    @line_magic
    def accel_setup(self, line: str = "") -> Plan:
        """Probe the runtime, decide a plan, build a CPU-safe Accelerator and show the panel.

        Returns the plan, so `plan = %accel_setup` works.
        """
        from .accelerator import SetupError, build_accelerator, prepare_environment, reset_state

        args = _parse(self.accel_setup, line, "accel_setup")
        request = self._request(args)
        name = self._target_name(args)
        runtime = probe(self.shell)
        try:
            plan = make_plan(runtime, request)
            notes = prepare_environment(plan)
        except (PlanError, SetupError) as err:
            raise UsageError(str(err)) from None
        if reset_state():
            notes.append(
                "accelerate's state was reset for these settings: Accelerator objects made before this call "
                f"no longer work; use `{name}`."
            )
        try:
            accelerator = build_accelerator(plan)
        except Exception as err:  # accelerate's own refusals, in one line
            raise UsageError(f"accelerate could not build the Accelerator: {err}") from None
        self.shell.user_ns[name] = accelerator
        plan = replace(plan, notes=plan.notes + tuple(notes))
        self.plan = plan
        from .display import mark_shown, show_plan

        if args.quiet:
            mark_shown(plan)
        else:
            show_plan(plan, by_magic=True)
        return plan
