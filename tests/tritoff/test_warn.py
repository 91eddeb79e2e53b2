import sys
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

from tritoff.warn import TritoffWarning, warn


def _in_module(module_name: str, inner):
    """A function defined in a module named ``module_name`` that calls ``inner``: a frame of that module."""
    namespace = {"__name__": module_name, "inner": inner}
    exec("def call(*args):\n    return inner(*args)\n", namespace)
    return namespace["call"]


def _record(call, *args) -> warnings.WarningMessage:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call(*args)
    (record,) = seen
    return record


def test_a_warning_raised_in_library_frames_names_the_users_line():
    hook = _in_module("tritoff.manager", warn)  # tritoff warns inside accelerate's wrapper inside torch's module call
    module_call = _in_module("torch.nn.modules.module", _in_module("accelerate.hooks", hook))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        line = sys._getframe().f_lineno + 1
        module_call("careful")
    (record,) = seen
    assert str(record.message) == "careful" and record.category is TritoffWarning
    assert (record.filename, record.lineno) == (__file__, line)


def test_only_whole_top_level_names_are_libraries():
    user = _in_module("torchvision_user.app", _in_module("tritoff.engine", warn))
    record = _record(user, "here", DeprecationWarning)
    assert record.category is DeprecationWarning and record.filename == "<string>"  # the user's frame, from exec


def test_a_warning_in_a_thread_with_no_user_frame_names_tritoffs_line():
    # a thread whose target is library code (a pipeline's call, tritoff's disk reader) has no user frame below it:
    # the warning names the frame that called warn, not threading.py
    target = _in_module("diffusers.pipeline", _in_module("tritoff.disk", warn))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        worker = threading.Thread(target=target, args=("in a thread",))
        worker.start()
        worker.join()
    (record,) = seen
    assert str(record.message) == "in a thread" and record.filename == "<string>"  # the exec'd tritoff.disk frame


def test_a_warning_in_a_pool_worker_with_no_user_frame_names_tritoffs_line():
    target = _in_module("diffusers.pipeline", _in_module("tritoff.disk", warn))
    with warnings.catch_warnings(record=True) as seen, ThreadPoolExecutor(1) as pool:
        warnings.simplefilter("always")
        pool.submit(target, "in a pool").result()
    (record,) = seen
    assert str(record.message) == "in a pool" and record.filename == "<string>"
