"""A kernel inside a memory-limited cgroup (made under the test's own, removed afterwards): the panel shows the
limit, and a rank that takes more than the limit allows is the one the out-of-memory killer ends, in one sentence
naming the rank, its peak and the limit; the notebook keeps its variables and the next launch works."""

from __future__ import annotations

import re

from cgroups import memory_cgroup

LIMIT = 1536 * 2**20  # a warm kernel (torch imported) takes about 600 MB; its ranks share those pages until written


def test_a_rank_over_the_limit_is_the_one_killed_and_says_its_peak_and_the_limit_and_the_kernel_goes_on(
    live_kernel,
) -> None:
    with memory_cgroup(LIMIT) as cgroup:
        (cgroup.folder / "cgroup.procs").write_text(str(live_kernel.km.provisioner.process.pid))
        try:
            panel = live_kernel.text(
                "import torch\n%load_ext accel_magic\nplan = %accel_setup --quiet\nprint(repr(plan))"
            )
            assert re.search(rf"memory +1\.5 GiB \({cgroup.version} limit\), [\d.]+ GiB available", panel), panel
            live_kernel.text("keep = {'weights': torch.ones(3), 'note': 'before'}")
            ranks = live_kernel.text("%%accel_train -n 2 --no-return\nprint(open('/proc/self/oom_score_adj').read())")
            kernel = live_kernel.text("print(open('/proc/self/oom_score_adj').read())")
            assert ranks.count("1000") == 2 and kernel.strip() == "0", (ranks, kernel)  # the ranks go first
            _, outputs = live_kernel.execute(
                "%%accel_train -n 2\nhog = []\nwhile True:\n    hog.append(torch.ones(25_000_000))  # 100 MB more"
            )
            errors = [o["evalue"] for o in outputs if o["output_type"] == "error"]
            assert len(errors) == 1 and re.fullmatch(
                r"rank [01] was killed by the out-of-memory killer at [\d.]+ GiB \(its peak; the kernel and its ranks "
                rf"may use 1\.5 GiB, the {cgroup.version} limit\): try fewer ranks, a smaller batch or bf16 mixed "
                r"precision; the other ranks were stopped\.",
                errors[0],
            ), outputs
            assert live_kernel.text("print(keep['note'], keep['weights'].sum().item())").strip() == "before 3.0"
            assert live_kernel.text("%%accel_train -n 2\nprint('again')").count("again") == 2
        finally:
            live_kernel.close()


def test_a_launch_that_will_need_more_than_is_available_says_so_before_it_starts_and_strict_refuses(
    live_kernel,
) -> None:
    with memory_cgroup(LIMIT) as cgroup:
        (cgroup.folder / "cgroup.procs").write_text(str(live_kernel.km.provisioner.process.pid))
        try:
            live_kernel.text(
                "import torch\n%load_ext accel_magic\n%accel_setup --quiet\n"
                "model = torch.nn.Linear(8192, 8192)  # 268 MB of weights: AdamW's state twice that, in each rank\n"
                "opt = torch.optim.AdamW(model.parameters())\nsmall = torch.nn.Linear(8, 8)"
            )
            look = "print(sum(p.numel() for p in model.parameters()), opt.defaults['lr'])"
            said = live_kernel.text(f"%%accel_train -n 2 --no-return\n{look}")
            warning = re.search(r"^The 2 ranks will need about ([\d.]+) GiB beyond.*$", said, re.M)
            assert warning and float(warning[1]) > 3, said  # 2 x (weights, gradients, state, buckets) and more
            assert warning[0].endswith(
                "available: a rank may be killed for memory; try fewer ranks, a smaller batch or bf16 mixed precision."
            ), said
            assert said.index("accel_train: 2 processes") < said.index(warning[0]) < said.index("67117056 0.001")
            assert said.count("67117056 0.001") == 2  # it went on
            last = live_kernel.text("print(id(accel_result))")
            refused = live_kernel.text(f"%%accel_train -n 2 --strict --no-return\n{look}")
            assert re.fullmatch(
                r"UsageError: The 2 ranks will need about [\d.]+ GiB beyond what they share with the kernel, more "
                r"than the [\d.]+ (GiB|MiB) available: nothing was launched \(without --strict it would start "
                r"anyway\); try fewer ranks, a smaller batch or bf16 mixed precision\.\n",
                refused,
            ), refused
            assert live_kernel.text("print(id(accel_result))") == last  # no launch, no outcome
            in_kernel = live_kernel.text(f"%%accel_train -n 1\n{look}")
            assert re.match(r"This cell will need about [\d.]+ GiB, more than the .* restart, losing", in_kernel)
            assert in_kernel.strip().endswith("67117056 0.001"), in_kernel
            small = live_kernel.text("%%accel_train -n 2 --strict --no-return\nprint(small.weight.shape)")
            assert "will need" not in small and small.count("torch.Size([8, 8])") == 2, small
        finally:
            live_kernel.close()
