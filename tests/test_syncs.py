"""The pure parts of SyncGuard: which calls sync (`classify`), whose code made them (`attribute`),
what the report says (`SyncGroup`), and the recorder (`SyncWatch`)."""

from __future__ import annotations

import os
import threading
from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_boost.guards.sources import Site
from lightning_boost.guards.sync_watch import SyncWatch
from lightning_boost.guards.syncs import CAUSES, Packages, SyncGroup, attribute, classify, code_at
from lightning_boost.step_probe import StepProbe
from lightning_boost.testing import BoringModel

T = torch.Tensor
x = torch.arange(6.0)
labels = torch.tensor([0, 2, 1])
mask = x > 2


@pytest.mark.parametrize(
    ("func", "args", "kwargs", "expected"),
    [
        (T.item, (x[0],), None, "item"),
        (T.__float__, (x[0],), None, "float"),
        (T.__bool__, (mask[0],), None, "bool"),
        (T.__contains__, (labels, 2), None, "bool"),
        (T.__index__, (labels[0],), None, "index"),
        (T.__format__, (x[0], ".3f"), None, "format"),
        (T.__repr__, (x,), None, "print"),
        (T.cpu, (x,), None, "cpu"),
        (T.to, (x, "cpu"), None, "to_cpu"),
        (T.to, (x,), {"device": "cpu"}, "to_cpu"),
        (T.to, (x, "cpu"), {"non_blocking": True}, None),
        (T.to, (x, "cpu", torch.float32, True), None, None),  # non_blocking by position
        (T.to, (x, torch.device("cpu")), None, None),  # a device object: the GPU on a GPU run
        (T.to, (x, torch.float64), None, None),
        (T.tolist, (x,), None, "tolist"),
        (T.numpy, (x,), None, "numpy"),
        (torch.nonzero, (mask,), None, "nonzero"),
        (torch.argwhere, (mask,), None, "nonzero"),
        (torch.where, (mask,), None, "nonzero"),
        (torch.where, (mask, x, 0.0), None, None),
        (T.__getitem__, (x, mask), None, "mask_index"),
        (T.__getitem__, (x, (mask,)), None, "mask_index"),
        (T.__getitem__, (x, labels), None, None),
        (T.__getitem__, (x, slice(0, 2)), None, None),
        (T.__getitem__, (x, slice(labels[0], labels[0] + 2)), None, "slice_bound"),
        (T.__getitem__, (x, (Ellipsis, slice(None, None, labels[0]))), None, "slice_bound"),
        (T.__setitem__, (x, slice(labels[0], None), 0.0), None, "slice_bound"),
        (F.ctc_loss, (x, labels, labels, labels), None, "ctc_lengths"),
        (F.ctc_loss, (x, labels, [3], [2]), None, None),  # lengths as Python lists: on the host
        (F.ctc_loss, (x, labels), {"input_lengths": [3], "target_lengths": labels}, "ctc_lengths"),
        (T.__setitem__, (x, mask, 0.0), None, "mask_assign"),
        (T.index_put_, (x, (mask,), torch.tensor(0.0)), None, "mask_assign"),
        (torch.masked_select, (x, mask), None, "masked_select"),
        (torch.unique, (labels,), None, "unique"),
        (T.unique_consecutive, (labels,), None, "unique"),
        (torch.repeat_interleave, (x[:3], labels), None, "repeat_interleave"),
        (torch.repeat_interleave, (x[:3], labels), {"output_size": 3}, None),
        (torch.repeat_interleave, (x, 2), None, None),
        (F.one_hot, (labels,), None, "one_hot"),
        (F.one_hot, (labels, -1), None, "one_hot"),
        (F.one_hot, (labels, 3), None, None),  # validated with .item() on CPU kernels only
        (F.one_hot, (labels,), {"num_classes": 3}, None),
        (torch.bincount, (labels,), None, "bincount"),
        (torch.equal, (x, x), None, "equal"),
        (torch.allclose, (x, x), None, "equal"),
        (torch.add, (x, x), None, None),
        (T.sum, (x,), None, None),
    ],
)
def test_classify_models_a_gpu_run_on_cpu_tensors(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, expected: str | None
) -> None:
    assert classify(func, args, kwargs, cuda=False) == expected


def test_on_a_gpu_run_only_calls_on_gpu_tensors_sync() -> None:
    assert classify(T.item, (x[0],), None, cuda=True) is None
    assert classify(T.__getitem__, (x, mask), None, cuda=True) is None
    assert classify(T.to, (x, torch.device("cpu")), None, cuda=True) is None  # already there


# -- attribute ---------------------------------------------------------------------------------

VENV = os.sep.join(["", "venv", "site-packages"])
PACKAGES = {
    f"{VENV}/torchmetrics/aggregation.py": "torchmetrics",
    f"{VENV}/torchmetrics/functional/classification/stat_scores.py": "torchmetrics",
    f"{VENV}/torchmetrics/functional/classification/accuracy.py": "torchmetrics",
    f"{VENV}/torchmetrics/utilities/compute.py": "torchmetrics",
    f"{VENV}/torchmetrics/metric.py": "torchmetrics",
    f"{VENV}/torch/_tensor.py": "torch",
    f"{VENV}/torch/nn/modules/module.py": "torch",
    f"{VENV}/torch/utils/data/dataloader.py": "torch",
    f"{VENV}/lightning/fabric/utilities/apply_func.py": "lightning",
    f"{VENV}/lightning/pytorch/callbacks/progress/tqdm_progress.py": "lightning",
    f"{VENV}/lightning/pytorch/trainer/call.py": "lightning",
    f"{VENV}/lightning/pytorch/strategies/strategy.py": "lightning",
    f"{VENV}/lightning/pytorch/loops/training_epoch_loop.py": "lightning",
    f"{VENV}/lightning/pytorch/loops/fit_loop.py": "lightning",
    "/usr/lib/python3.11/threading.py": "python",
}.get


def frame(path: str, line: int = 1, function: str = "f") -> Site:
    return Site(path.replace("/", os.sep) if path.startswith("/") else f"{VENV}/{path}", line, function)


LOOP = frame("lightning/pytorch/loops/fit_loop.py", 300, "run")
SCRIPT = frame("/home/me/train.py", 9, "<module>")


def test_a_user_line_inside_nested_user_code_names_the_hook() -> None:
    a = attribute(
        [
            frame("/home/me/model.py", 30, "forward"),
            frame("torch/nn/modules/module.py", 1, "_call_impl"),
            frame("/home/me/model.py", 41, "training_step"),
            frame("lightning/pytorch/strategies/strategy.py", 2, "training_step"),
            LOOP,
            SCRIPT,
        ],
        PACKAGES,
    )
    assert a is not None and a.site is not None
    assert (a.site.location, a.hook, a.library, a.framework) == (
        f"{os.sep}home{os.sep}me{os.sep}model.py:30",
        "training_step",
        None,
        False,
    )


def test_torch_tensor_api_frames_are_not_a_library() -> None:
    a = attribute(
        [frame("torch/_tensor.py", 1, "__repr__"), frame("/home/me/model.py", 5, "step"), LOOP], PACKAGES
    )
    assert a is not None and a.library is None and a.site is not None and a.site.line == 5


def test_a_framework_sync_stops_at_the_loops_and_never_blames_the_script() -> None:
    a = attribute(
        [
            frame("lightning/fabric/utilities/apply_func.py", 134, "convert_tensors_to_scalars"),
            frame("lightning/pytorch/callbacks/progress/tqdm_progress.py", 280, "on_train_batch_end"),
            frame("lightning/pytorch/trainer/call.py", 3, "_call_callback_hooks"),
            frame("lightning/pytorch/loops/training_epoch_loop.py", 4, "advance"),
            LOOP,
            SCRIPT,
        ],
        PACKAGES,
    )
    assert a is not None and a.site is None and a.framework
    assert a.cause is not None and a.cause.key == "progress_bar"


def test_the_frameworks_syncs_of_no_known_cause_are_one_group_per_function() -> None:
    """Two lines of one library function called by the framework (no user line) were two findings
    of one title ("torch syncs in `update`"); a user's line stays its own group."""

    def at(line: int, user: bool = False) -> Any:
        mine = [frame("/home/me/model.py", 7, "on_train_batch_end")] if user else []
        return attribute(
            [
                frame("torch/nn/modules/module.py", line, "update"),
                *mine,
                frame("lightning/pytorch/trainer/call.py", 3, "hook"),
                LOOP,
            ],
            PACKAGES,
        )

    first, second = at(10), at(20)
    assert first.framework and SyncGroup.key("training", first) == SyncGroup.key("training", second)
    assert SyncGroup.key("training", at(10, user=True)) != SyncGroup.key("training", first)
    group = SyncGroup("training", first)
    group.add("bool", attribution=first)
    group.add("bool", attribution=second)
    assert group.title(1) == "torch syncs in `update` (2x per training step)"


def test_the_most_specific_cause_wins() -> None:
    sigterm = frame("lightning/pytorch/loops/training_epoch_loop.py", 269, "_broadcast_sigterm_tensor")
    a = attribute(
        [sigterm, frame("lightning/pytorch/loops/training_epoch_loop.py", 300, "advance")], PACKAGES
    )
    assert a is not None and a.cause is not None and a.cause.key == "sigterm"
    assert [c.key for c in CAUSES][-1] == "logging"  # the generic one is tried last


def test_torchmetrics_input_checks_are_one_cause_and_its_computations_are_others() -> None:
    user = frame("/home/me/model.py", 41, "training_step")
    forward = frame("torchmetrics/metric.py", 1, "_forward_reduce_state_update")
    check = frame(
        "torchmetrics/functional/classification/stat_scores.py",
        71,
        "_multiclass_stat_scores_tensor_validation",
    )
    reduce = frame("torchmetrics/functional/classification/accuracy.py", 9, "_accuracy_reduce")
    weights = frame("torchmetrics/utilities/compute.py", 92, "_adjust_weights_safe_divide")
    # the checks `validate_args=False` turns off, even inside a call of the metric
    a = attribute([check, forward, user, LOOP], PACKAGES)
    assert a is not None and a.cause is not None and a.cause.key == "metric_validation"
    # the batch's value a call computes runs in `/functional/` too: not an input check
    a = attribute([weights, reduce, forward, user, LOOP], PACKAGES)
    assert a is not None and a.cause is not None and a.cause.key == "metric_forward"


def test_a_library_between_the_user_and_the_sync_is_named() -> None:
    a = attribute(
        [
            frame("torchmetrics/aggregation.py", 93, "_cast_and_nan_check_input"),
            frame("/home/me/model.py", 41, "training_step"),
            LOOP,
        ],
        PACKAGES,
    )
    assert a is not None and not a.framework and a.package == "torchmetrics"
    assert a.cause is not None and a.cause.key == "metric_nan_check"


def test_data_loading_is_not_a_sync_of_the_step() -> None:
    frames = [
        frame("/home/me/data.py", 12, "__getitem__"),
        frame("torch/utils/data/dataloader.py", 1, "__next__"),
        LOOP,
    ]
    assert attribute(frames, PACKAGES) is None


def test_packages_tell_the_users_code_from_installed_code() -> None:
    packages = Packages()
    assert packages(torch.__file__) == "torch"
    assert packages(os.__file__) == "python"
    assert packages(__file__) is None
    assert packages("<frozen importlib._bootstrap>") == "python"


# -- SyncGroup ---------------------------------------------------------------------------------


def test_a_group_counts_per_checked_step_and_gives_the_fix() -> None:
    a = attribute([frame("/home/me/model.py", 41, "training_step"), LOOP], PACKAGES)
    assert a is not None
    group = SyncGroup("training", a, code="value = loss.item()")
    for _ in range(4):
        group.add("item")
    group.add("print")
    assert group.title(steps=2) == "`value = loss.item()` syncs 2.5x per training step in training_step"
    assert "(4x)" in group.detail(2, cpu_run=True) and "on a GPU" in group.detail(2, cpu_run=True)
    assert "self.log" in group.fix() and "print" in group.fix()
    assert group.to_data(2)["syncs"] == {"item": 4, "print": 1}
    assert SyncGroup.key("training", a) != SyncGroup.key("validation", a)


def test_a_line_whose_syncs_are_all_inside_one_library_gets_one_sentence_for_it() -> None:
    """Syncs in several functions of a library of no known cause under one user line (torchvision's
    Faster R-CNN made 16 before it had a cause of its own): its finding said "It syncs inside
    torchvision (in `...`): look for a torchvision setting ..." once per function."""
    files = {f"{VENV}/torchvision/ops/{name}.py": "torchvision" for name in ("a", "b", "c")}

    def packages(path: str) -> str | None:
        return files.get(path) or PACKAGES(path)

    user = frame("/home/me/model.py", 27, "training_step")
    mine = attribute([user, LOOP], packages)
    assert mine is not None
    group = SyncGroup("training", mine, code="losses = self.model(images)")
    for name, function in (("a", "normalize"), ("b", "decode_single"), ("c", "compute_loss")):
        library = frame(f"torchvision/ops/{name}.py", 5, function)
        group.add("bool", attribution=attribute([library, user, LOOP], packages))
    fix, detail = group.fix(), group.detail(1, cpu_run=False)
    assert fix.count("inside torchvision") == 1 and detail.count("Inside torchvision") == 1
    for function in ("normalize", "decode_single", "compute_loss"):
        assert f"`{function}`" in fix and function in detail


def test_code_at_drops_the_comment_but_keeps_a_hash_in_a_string(tmp_path: Any) -> None:
    source = tmp_path / "m.py"
    source.write_text('x = f"#{loss}"  # a comment\ncall(a,\n')
    assert code_at(Site(str(source), 1, "m")) == 'x = f"#{loss}"'
    assert code_at(Site(str(source), 2, "m")) == "call(a,"  # unfinished: kept whole


# -- SyncWatch ---------------------------------------------------------------------------------


def test_the_watch_records_while_active_and_restores_everything() -> None:
    seen: list[str] = []
    watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
    synchronize = torch.cuda.synchronize
    values = torch.arange(3.0)  # made before the watch: a GPU run's device tensor
    watch.start()
    watch.start()  # idempotent
    assert torch.cuda.synchronize is not synchronize
    values.sum().item()
    host = values.cpu()
    host.tolist()  # a host copy: reading it does not sync on a GPU either
    torch.cuda.empty_cache()
    assert watch.stop() == {}
    values.sum().item()  # stopped: not seen
    assert seen == ["item", "cpu", "empty_cache"]
    assert torch.cuda.synchronize is synchronize
    assert not torch.overrides._get_current_function_mode_stack()


class Reads(torch.utils.data.Dataset[torch.Tensor]):
    """Each sample reads a tensor made before the watch (a sync, were it in the step); `wait`, when
    set, holds the first sample until it is set from the test (`entered` says it got there)."""

    def __init__(self, wait: threading.Event | None = None) -> None:
        self.values = torch.arange(4.0)
        self.wait, self.entered = wait, threading.Event()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        self.entered.set()
        if self.wait is not None:
            self.wait.wait(timeout=10)
        return self.values[index] * float(self.values[index].item())


def test_a_dataloader_making_a_batch_on_the_watched_thread_is_not_watched() -> None:
    """Loading runs on the host by design: its reads are neither reported nor classified, and the
    step after it is watched as before; stopping puts the loader's ``__next__`` back."""
    seen: list[str] = []
    watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
    iterator = torch.utils.data.dataloader._BaseDataLoaderIter
    original = iterator.__next__
    data = Reads()  # made before the watch: a GPU run's device tensor
    watch.start()
    try:
        batch = next(iter(torch.utils.data.DataLoader(data, batch_size=4)))
        data.values.sum().item()  # a read in the step: seen
    finally:
        watch.stop()
    assert batch.shape == (4,) and seen == ["item"]
    assert iterator.__next__ is original and watch.loading == 0


def test_another_threads_loading_leaves_the_watched_thread_watched() -> None:
    """A tuner's loader on another thread, mid-batch, does not blind the watch to the step's
    syncs (the mode sees only its own thread; the pause is its thread's too)."""
    seen: list[str] = []
    release = threading.Event()
    data = Reads(wait=release)
    loader = threading.Thread(target=lambda: next(iter(torch.utils.data.DataLoader(data, batch_size=4))))
    watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
    watch.start()
    try:
        loader.start()
        assert data.entered.wait(timeout=10)  # the other thread is inside `__next__` now
        data.values.sum().item()
    finally:
        release.set()
        loader.join(timeout=10)
        watch.stop()
    assert seen == ["item"]


def test_a_raising_callback_stops_the_call_before_it_runs() -> None:
    def refuse(pattern: str, frame: Any) -> None:
        raise RuntimeError(pattern)

    watch = SyncWatch(refuse, cuda=False)
    loss = torch.ones(1)
    watch.start()
    try:
        with pytest.raises(RuntimeError, match="item"):
            loss.item()
    finally:
        watch.stop()


def test_the_packs_own_steps_on_a_copy_are_not_watched() -> None:
    """The worker search times a copy of the model between the run's steps (`StepProbe.stepper`).
    The copy's Adam made its step counters in an unchecked step; Adam reads them with `.item()`,
    which a GPU run keeps on the host (the guard marks the run's own optimizer's): a checked
    step's window saw the copy's reads as syncs, 8 over 10 checked steps of a CPU run."""
    model = BoringModel()
    adam = torch.optim.Adam(model.parameters())
    batch = (torch.randn(4, 32), torch.randn(4, 2))
    step = StepProbe(model, [adam], 1, nullcontext, nullcontext).stepper()
    step(batch, None)  # the copy's Adam makes its counters, unwatched
    seen: list[str] = []
    watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
    watch.start()
    try:
        step(batch, None)
        model(batch[0]).sum().item()  # the user's own read is still seen
    finally:
        watch.stop()
    assert seen == ["item"]


def test_a_packed_sequences_batch_sizes_stay_on_the_host() -> None:
    """`pack_padded_sequence` makes `batch_sizes` where its lengths are (torch requires them on
    the host), so an RNN reading it (`int(batch_sizes[0])` in `get_expected_hidden_size`) does not
    sync on a GPU. Host lengths from the `collate_fn` (a Python list) leave nothing to report; the
    sort order of `enforce_sorted=False` copied to the GPU is a real sync, inside torch."""
    seen: list[str] = []
    rnn = torch.nn.GRU(4, 8, batch_first=True)
    padded = torch.randn(3, 5, 4)  # made before the watch: a GPU run's device tensor
    watch = SyncWatch(lambda pattern, frame: seen.append(pattern), cuda=False)
    watch.start()
    try:
        packed = torch.nn.utils.rnn.pack_padded_sequence(padded, [5, 3, 2], batch_first=True)
        rnn(packed)
        assert seen == []
        unsorted = torch.nn.utils.rnn.pack_padded_sequence(padded, [2, 5, 3], True, enforce_sorted=False)
        rnn(unsorted)
    finally:
        watch.stop()
    assert seen == ["h2d"]
