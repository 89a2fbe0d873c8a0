"""AccelMagics: the options of `%accel_setup` and `%%accel_train` as arguments and traits (checked in
options.py), and every refusal as one IPython UsageError; the work itself is done by the modules it calls."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from traitlets import Bool, Enum, Float, Int, TraitError, Unicode, validate

from .accelerator import build_accelerator, prepare_environment, reset_state
from .cell import compile_cell
from .errors import CellError, ExportError, LaunchInterrupted, PlanError, SetupError, TrainError
from .export import DEFAULT_PORT, export_from_history
from .jobs import Job, last_job, refuse_while_running, start_job
from .launch import LaunchOutcome
from .launcher import guard_accelerate_launcher
from .options import (
    choice,
    count,
    given,
    identifier,
    nodes,
    parse,
    parse_port,
    plan_arguments,
    positive_float,
    positive_int,
    returned_names,
)
from .panel import mark_shown, show_plan
from .plan import ALLREDUCE, DEFAULT_TIMEOUT, MIXED_PRECISION, STRATEGIES, Plan, Request, make_plan
from .runtime import Runtime, probe
from .train import fit_in_kernel, launch_interrupted, run_in_kernel, run_ranks, stopped_before_start

__all__ = ["AccelMagics"]

STRICT = "refuse instead of falling back, or of starting short of memory"


def _is_accelerator(obj: Any) -> bool:
    """An accelerate Accelerator (the notebook's own, built on first use, is one), without importing accelerate."""
    cls = type(obj)
    accelerate = sys.modules.get("accelerate")
    return (cls.__name__ == "Accelerator" and cls.__module__.startswith("accelerate")) or (
        accelerate is not None and isinstance(obj, accelerate.Accelerator)
    )


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
    strict = Bool(
        False,
        help="Refuse instead of falling back when a request cannot be honoured, or of starting a launch "
        "that will need more memory than is available.",
    ).tag(config=True)
    name = Unicode("accelerator", help="Name of the Accelerator variable in the notebook.").tag(config=True)
    timeout = Float(
        DEFAULT_TIMEOUT,
        help="Seconds a collective (all-reduce, barrier) may wait for the other ranks before the launch fails. "
        "Long enough for rank 0 to evaluate while the others wait at a barrier.",
    ).tag(config=True)
    max_return_mb = Float(1024.0, help="Limit, in MB, on what rank 0 sends back to the notebook.").tag(config=True)
    result = Unicode("accel_result", help="Name of the variable that receives how the last launch ended.").tag(
        config=True
    )
    allreduce = Enum(
        ALLREDUCE,
        None,
        allow_none=True,
        help="How CPU ranks on this machine average gradients: shm (in shared memory, the default where it works) "
        "or gloo (the process group's all-reduce).",
    ).tag(config=True)

    max_restarts = Int(
        0, help="Times every rank is started again after a rank failed, as torch elastic does (max_restarts)."
    ).tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any):
        super().__init__(shell=shell, **kwargs)
        self.plan: Plan | None = None
        self.setup_name: str | None = None  # an explicit %accel_setup --name; else the `name` trait decides

    @validate("num_processes")
    def _check_num_processes(self, proposal: Any) -> Any:
        if proposal.value is not None and proposal.value < 1:
            raise TraitError(f"num_processes must be at least 1, not {proposal.value}.")
        return proposal.value

    @validate("max_restarts")
    def _check_max_restarts(self, proposal: Any) -> Any:
        if proposal.value < 0:
            raise TraitError(f"max_restarts must be at least 0, not {proposal.value}.")
        return proposal.value

    @validate("name", "result")
    def _check_name(self, proposal: Any) -> Any:
        if not identifier(proposal.value):
            raise TraitError(f"{proposal.trait.name} must be a Python identifier, not {proposal.value!r}.")
        return proposal.value

    def _request(self, args: Any) -> Request:
        n = positive_int(args.num_processes, "-n/--num-processes")
        return Request(
            num_processes=n if n is not None else self.num_processes,
            cpu=args.cpu or self.cpu,
            mixed_precision=choice(args.mixed_precision, MIXED_PRECISION, "--mixed-precision") or self.mixed_precision,
            strategy=choice(args.strategy, STRATEGIES, "--strategy") or self.strategy,
            strict=args.strict or self.strict,
            timeout=self.timeout,
            allreduce=choice(args.allreduce, ALLREDUCE, "--allreduce") or self.allreduce,
        )

    def _target_name(self, args: Any) -> str:
        name = args.name if args.name is not None else self.name
        if not identifier(name):
            raise UsageError(f"--name must be a Python identifier such as accelerator, not {name!r}.")
        existing = self.shell.user_ns.get(name)
        if existing is not None and not args.force and not _is_accelerator(existing):
            kind = type(existing).__name__
            raise UsageError(f"`{name}` already holds a {kind}: pass --force to replace it, or choose another --name.")
        return name

    def _result_name(self, args: Any) -> str:
        """Where the launch's outcome goes: never over a variable of the user's own without a word."""
        name = args.result if args.result is not None else self.result
        if not identifier(name):
            raise UsageError(f"--result must be a Python identifier such as accel_result, not {name!r}.")
        existing = self.shell.user_ns.get(name)
        if existing is not None and not isinstance(existing, LaunchOutcome | Job):
            kind = type(existing).__name__
            raise UsageError(
                f"`{name}` already holds a {kind}: choose another name for the launch's outcome with --result "
                "(or %config AccelMagics.result); nothing was launched."
            )
        return name

    @property
    def accelerator_name(self) -> str:
        """The variable that holds the Accelerator: an explicit %accel_setup --name, else the `name` trait."""
        return self.setup_name or self.name

    def _setup(self, request: Request, name: str, quiet: bool, runtime: Runtime | None = None) -> Plan:
        runtime = runtime or probe(self.shell)
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
        guard_accelerate_launcher(plan)
        plan = replace(plan, notes=plan.notes + tuple(notes))
        self.plan = plan
        if quiet:
            mark_shown(plan)
        else:
            show_plan(plan, by_magic=True)
        return plan

    @magic_arguments()
    @plan_arguments
    @argument("--strategy", metavar="S", help="ddp, fsdp or deepspeed")
    @argument("--strict", action="store_true", help=STRICT)
    @argument("--name", metavar="NAME", help="variable for the Accelerator (default: accelerator)")
    @argument("--force", action="store_true", help="replace a variable of that name that is not an Accelerator")
    @argument("--quiet", action="store_true", help="do not show the panel")
    @line_magic
    def accel_setup(self, line: str = "") -> Plan:
        """Probe the runtime, decide a plan, build a CPU-safe Accelerator and show the panel.

        Returns the plan, so `plan = %accel_setup` works.
        """
        args = parse(self.accel_setup, line, "accel_setup")
        request = self._request(args)
        name = self._target_name(args)
        plan = self._setup(request, name, args.quiet)
        self.setup_name = args.name
        return plan

    @magic_arguments()
    @plan_arguments
    @argument("--timeout", metavar="S", help="seconds a collective may wait for the other ranks (default 900)")
    @argument("--port", metavar="P", help="rendezvous port on 127.0.0.1 (default: a free one)")
    @argument("--no-return", action="store_true", help="bring nothing back to the notebook")
    @argument("--return", dest="returns", metavar="NAMES", help="bring back only these names (comma-separated)")
    @argument("--max-return-mb", metavar="MB", help="limit on what comes back (default 1024)")
    @argument("--result", metavar="NAME", help="variable for how the launch ended (default: accel_result)")
    @argument("--nodes", metavar="M", help="machines whose kernels train as one group (each runs -n ranks)")
    @argument("--node-rank", metavar="R", help="this machine's place, 0 to M-1; node 0 hosts the rendezvous")
    @argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and port, the same on every node")
    @argument("--background", action="store_true", help="return once the ranks run; results come at the next cell")
    @argument("--max-restarts", metavar="N", help="start every rank again after a rank failed, up to N times")
    @argument("--strict", action="store_true", help=STRICT)
    @cell_magic
    def accel_train(self, line: str, cell: str) -> None:
        """Run the cell as N ranks (forked processes forming one process group) and bring rank 0's results
        back: the names the cell binds, and the trained state of the notebook's models, optimizers, LR schedulers
        and objects registered for checkpointing that went through accelerator.prepare, loaded into the
        notebook's own objects.

        `-n 1` on CPU or one GPU runs in the kernel like a normal cell. Names bound dynamically (exec,
        globals()[...]) are not seen by --return.

        Several machines: run the same cell in a kernel on each, with `--nodes M --node-rank R --rdzv-endpoint
        HOST:PORT` (node 0's address); their M x N ranks form one group, numbered by node rank, and each kernel
        shows its own ranks' output and gets its first rank's results back.

        `--background`: the cell returns once the ranks run, and leaves a status widget with a Stop button; other
        cells run meanwhile. `accel_result` is the job (status, wait(), stop(), outcome); rank 0's results come
        into the notebook when the first cell after the end runs (names rebound meanwhile are kept, and the
        launch's values left in the job's `results`), or at once with %accel_wait. One background launch at a time.

        `--max-restarts N`: after a rank failed, every rank starts again (one line says so), up to N times, as
        torch elastic does; the results come from the run that succeeded.
        """
        args = parse(self.accel_train, line, "accel_train")
        try:
            self._train(args, cell)
        except KeyboardInterrupt as err:
            if hasattr(err, "_render_traceback_"):  # the launch's own line
                raise
            raise self._stopped_before_start(args) from None  # an interrupt before the launch held them

    def _train(self, args: Any, cell: str) -> None:
        max_mb = positive_float(args.max_return_mb, "--max-return-mb") or self.max_return_mb
        port = parse_port(args.port)
        request = self._train_request(args)
        try:
            code = compile_cell(cell, self.shell.transform_cell)
            runtime = self.plan.runtime if self.plan is not None else probe(self.shell)
            plan = make_plan(runtime, request)
        except (PlanError, CellError) as err:
            raise UsageError(str(err)) from None
        for kind, magic in code.magics:
            if self.shell.find_magic(magic, kind) is None:
                sign = "%" if kind == "line" else "%%"
                raise UsageError(
                    f"The cell uses {sign}{magic}, which is not a magic here: check its name, or load its extension "
                    "in an earlier cell; nothing was launched."
                )
        returns = returned_names(args, code.bound)
        result_name = self._result_name(args)
        try:
            refuse_while_running()
        except TrainError as err:
            raise UsageError(str(err)) from None
        if plan.background:
            try:
                job = start_job(
                    self.shell,
                    code,
                    plan,
                    name=self.accelerator_name,
                    result_name=result_name,
                    returns=returns,
                    port=port,
                    max_bytes=int(max_mb * 2**20),
                )
            except TrainError as err:
                raise UsageError(str(err)) from None
            self.shell.user_ns[result_name] = job
            if job.outcome is not None:  # it ended before this cell did: as a foreground launch ends
                job.conclude()
            return
        if plan.launch == "kernel":
            if self.plan is None or self.plan.request != request:
                self._setup(request, self.accelerator_name, quiet=True, runtime=runtime)
            try:
                fit_in_kernel(code, self.shell.user_ns, plan)
            except TrainError as err:
                raise UsageError(str(err)) from None
            run_in_kernel(self.shell, cell, result_name)
            return
        try:
            run_ranks(
                self.shell,
                code,
                plan,
                name=self.accelerator_name,
                result_name=result_name,
                returns=returns,
                port=port,
                max_bytes=int(max_mb * 2**20),
            )
        except TrainError as err:
            raise UsageError(str(err)) from None

    @magic_arguments()
    @argument("path", help="the script to write, a .py file; the SLURM batch file goes next to it as <name>.slurm")
    @argument("--port", metavar="P", help="rendezvous port on the SLURM job's first node (default 29500)")
    @line_magic
    def accel_export(self, line: str = "") -> None:
        """Write the last %%accel_train cell run in this kernel as a script for `accelerate launch`, `torchrun` or
        `python`, with the earlier cells it uses, and a SLURM batch file next to it; print the commands.

        The earlier cells are those that define a name the training cell uses or change what it holds (a seed,
        loaded weights), followed transitively, in the order they ran; cells that only display are left out. Magics
        and ! lines become Python where they can; others are refused with the cell and line. The script builds its
        Accelerator from the training cell's plan and writes the trained state of each prepared model and optimizer
        to --output-dir. The notebook is left as it was.
        """
        args = parse(self.accel_export, line, "accel_export")
        port = parse_port(args.port) or DEFAULT_PORT
        runtime = self.plan.runtime if self.plan is not None else None

        def plan(options: str) -> Plan:  # the plan the training cell's options make here
            request = self._train_request(parse(self.accel_train, options, "accel_train"))
            return make_plan(runtime or probe(self.shell), request)

        try:
            export = export_from_history(self.shell, args.path, port, plan, self.accelerator_name)
            export.write()
        except (PlanError, ExportError) as err:
            raise UsageError(str(err)) from None
        except OSError as err:
            raise UsageError(f"Could not write {args.path}: {err.strerror or err}; choose another path.") from None
        print(export.summary())

    @magic_arguments()
    @line_magic
    def accel_wait(self, line: str = "") -> None:
        """Wait for the background launch to end and bring its results into the notebook at once; a failed
        launch shows its error here. Interrupting the wait leaves the launch running."""
        parse(self.accel_wait, line, "accel_wait")
        job = last_job()
        if job is None:
            raise UsageError("No background launch in this kernel: start one with %%accel_train --background.")
        try:
            job.ended.wait()
        except KeyboardInterrupt:
            raise LaunchInterrupted(
                f"stopped waiting; the background launch goes on ({job.name}.stop() ends it)"
            ) from None
        if job.applied:
            if job.told_in != self.shell.execution_count:  # else this cell's first line just said it
                print(job.note or f"The background launch ({job.name}) had ended: {job.status}.")
            return
        job.conclude()

    def _stopped_before_start(self, args: Any) -> KeyboardInterrupt:
        """An interrupt that came before the launch started: its one line, and its outcome in the launch's result
        variable (unless the interrupt came before a refusal)."""
        try:
            result_name, num_processes = self._result_name(args), self._train_request(args).num_processes or 0
        except UsageError:
            return launch_interrupted(stopped_before_start(0))
        outcome = stopped_before_start(num_processes)
        self.shell.user_ns[result_name] = outcome
        return launch_interrupted(outcome)

    def _train_request(self, args: Any) -> Request:
        base = self.plan.request if self.plan is not None else Request()
        n = positive_int(args.num_processes, "-n/--num-processes")
        mp = choice(args.mixed_precision, MIXED_PRECISION, "--mixed-precision")
        return replace(
            base,
            num_processes=n if n is not None else (base.num_processes or self.num_processes),
            cpu=args.cpu or base.cpu or self.cpu,
            mixed_precision=mp or base.mixed_precision or self.mixed_precision,
            allreduce=choice(args.allreduce, ALLREDUCE, "--allreduce") or base.allreduce or self.allreduce,
            timeout=positive_float(args.timeout, "--timeout") or base.timeout or self.timeout,
            background=args.background,
            strict=args.strict or base.strict or self.strict,
            max_restarts=given(count(args.max_restarts, "--max-restarts"), self.max_restarts),
            **nodes(args),
        )
