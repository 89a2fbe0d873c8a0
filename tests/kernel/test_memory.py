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
