"""The memory a launch will need, estimated from the notebook's models and optimizers the code uses: which objects
count, what each term adds, and the words when that is much or more than is available."""

from __future__ import annotations

import torch

from accel_magic.footprint import BASE_SHARE, Footprint, banner_line, estimate, fit_words, used_by, used_objects

MiB = 2**20


def _code(source: str):
    return compile(source, "<cell>", "exec")


class TrainerLike:  # an object that holds its model, as transformers' Trainer does
    def __init__(self, model):
        self.model = model
        self._private = torch.nn.Linear(9, 9)


def test_the_objects_counted_are_those_the_code_reads_directly_or_through_functions_containers_and_objects():
    model, other, unused = torch.nn.Linear(4, 4), torch.nn.Linear(5, 5), torch.nn.Linear(6, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ns: dict = {"model": model, "opt": opt, "unused": unused, "models": [other], "trainer": TrainerLike(other)}
    exec("def run():\n    return model, opt\n", ns)
    assert {id(o) for o in used_objects(_code("model, opt = accelerator.prepare(model, opt)"), ns)} == {
        id(model),
        id(opt),
    }
    assert {id(o) for o in used_objects(_code("run()"), ns)} == {id(model), id(opt)}
    assert [id(o) for o in used_objects(_code("for m in models: m(x)"), ns)] == [id(other)]
    assert [id(o) for o in used_objects(_code("trainer.train()"), ns)] == [id(other)]  # not its private layer
    assert used_objects(_code("print(1)"), ns) == []
    assert [id(o) for o in used_by(lambda m: m, (unused,))] == [id(unused)]  # a launched function's arguments


def test_a_cell_in_the_kernel_adds_its_gradients_its_optimizers_state_and_the_steps_temporaries():
    model = torch.nn.Linear(1000, 100)  # 100,100 parameters, the largest 100,000
    weights, largest = 100_100 * 4, 100_000 * 4
    adamw = torch.optim.AdamW(model.parameters())
    assert estimate([model, adamw], 1, in_kernel=True, shared_memory=False, kernel_private=0) == Footprint(
        1, weights + 2 * weights + 2 * largest, in_kernel=True
    )
    model(torch.randn(2, 1000)).sum().backward()
    adamw.step()  # gradients and state held already: only the step's temporaries are new
    assert estimate([model, adamw], 1, in_kernel=True, shared_memory=False, kernel_private=0).per_rank == 2 * largest


def test_each_forked_rank_adds_its_weights_gradients_state_buckets_and_a_share_of_the_kernels_pages():
    model = torch.nn.Sequential(torch.nn.Linear(1000, 100), torch.nn.BatchNorm1d(100))
    model[1].weight.requires_grad_(False)
    weights = (100_100 + 200) * 4 + 200 * 4 + 8  # parameters; the running mean and variance, and an int64 count
    trainable, largest = (100_100 + 100) * 4, 100_000 * 4  # all but the frozen BatchNorm weight
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    kernel = 600 * MiB
    two = estimate([model, sgd], 2, in_kernel=False, shared_memory=True, kernel_private=kernel)
    base = int(BASE_SHARE * (kernel - weights))  # the kernel's pages but its tensors counted above
    expected = weights + trainable + trainable + 2 * largest + trainable + base  # the last trainable: DDP's buckets
    assert two == Footprint(2, expected, shared=3 * trainable)
    assert two.total == 2 * expected + 3 * trainable
    alone = estimate([model, sgd], 1, in_kernel=False, shared_memory=True, kernel_private=kernel)
    assert alone == Footprint(1, expected - trainable)  # one forked rank: no buckets, no segment


def test_each_optimizer_counts_the_state_it_keeps():
    model = torch.nn.Linear(100, 10, bias=False)
    p = 1000 * 4

    def state(optimizer):
        whole = estimate([model, optimizer], 1, in_kernel=True, shared_memory=False, kernel_private=0).per_rank
        return whole - p - 2 * p  # less the gradients and the step's temporaries

    params = list(model.parameters())
    assert state(torch.optim.SGD(params, lr=0.1)) == 0
    assert state(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == p
    assert state(torch.optim.Adam(params, amsgrad=True)) == 3 * p
    assert state(torch.optim.RMSprop(params, momentum=0.9, centered=True)) == 3 * p
    assert state(torch.optim.Adagrad(params)) == 0  # it makes its state when built: held, nothing new
    adagrad, momentum = torch.optim.Adagrad(params), torch.optim.SGD(params, lr=0.1, momentum=0.9)
    forked = [
        estimate([model, o], 2, in_kernel=False, shared_memory=False, kernel_private=0) for o in (adagrad, momentum)
    ]
    assert abs(forked[0].per_rank - forked[1].per_rank) <= 8  # a rank writes it: its own copy (and a step count)


def test_the_words_say_how_much_of_what_is_available_and_strict_refuses():
    two = Footprint(2, 3 * 2**30, shared=2**30)  # 7 GiB
    assert fit_words(two, None, strict=False) == "" and banner_line(two, None) == ""
    assert fit_words(two, 8 * 2**30, strict=False) == ""
    assert banner_line(two, 8 * 2**30) == "memory: about 7.0 GiB needed beyond the kernel's, of 8.0 GiB available"
    assert banner_line(two, 14 * 2**30) == ""
    assert fit_words(two, 6 * 2**30, strict=False) == (
        "The 2 ranks will need about 7.0 GiB beyond what they share with the kernel, more than the 6.0 GiB "
        "available: a rank may be killed for memory; try fewer ranks, a smaller batch or bf16 mixed precision."
    )
    assert fit_words(two, 6 * 2**30, strict=True).startswith(
        "The 2 ranks will need about 7.0 GiB beyond what they share with the kernel, more than the 6.0 GiB "
        "available: nothing was launched (without --strict it would start anyway); try fewer ranks,"
    )
    in_kernel = Footprint(1, 300 * MiB, in_kernel=True)
    assert fit_words(in_kernel, 200 * MiB, strict=False) == (
        "This cell will need about 300 MiB, more than the 200 MiB available: the kernel may run out of memory and "
        "restart, losing the notebook's variables; try a smaller batch or bf16 mixed precision."
    )
    assert "nothing ran (without --strict it would start anyway)" in fit_words(in_kernel, 200 * MiB, strict=True)
