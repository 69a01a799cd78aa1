"""tests/hlo_schedule: reading whether XLA scheduled an operation inside an asynchronous
collective's window, on HLO text in the form XLA prints scheduled GPU modules (the multi-GPU
test of the fused layer beside an all_gather relies on it)."""

from hlo_schedule import flat_schedule, op_inside_async_window

TARGET = 'custom_call_target="megamoe_fused_moe_fwd"'

HEADER = ("HloModule jit_program, is_scheduled=true, "
          "entry_computation_layout={(f32[8]{0})->f32[8]{0}}\n")


def _module(entry_body: str, extra: str = "", sync: bool = False) -> str:
  start = ("  %all-gather-start = (s32[1,8]{1,0}, s32[2,8]{1,0}) "
           "all-gather-start(s32[1,8]{1,0} %p1), channel_id=1, replica_groups={{0,1}}, "
           'dimensions={0}, backend_config={"operation_queue_id":"0",'
           '"collective_backend_config":{"is_sync":' + ("true" if sync else "false")
           + ',"no_parallel_custom_call":false}}\n')
  done = ("  %all-gather-done = s32[2,8]{1,0} "
          "all-gather-done((s32[1,8]{1,0}, s32[2,8]{1,0}) %all-gather-start)\n")
  call = ('  %custom-call.1 = bf16[8]{0} custom-call(bf16[8]{0} %p0), ' + TARGET
          + ', api_version=API_VERSION_TYPED_FFI\n')
  body = entry_body.replace("{start}", start).replace("{done}", done).replace("{call}", call)
  return (HEADER + extra
          + "ENTRY %main.9 (p0: bf16[8], p1: s32[1,8]) -> (bf16[8], s32[2,8]) {\n"
          "  %p0 = bf16[8]{0} parameter(0)\n  %p1 = s32[1,8]{1,0} parameter(1)\n" + body
          + "  ROOT %tuple = (bf16[8]{0}, s32[2,8]{1,0}) "
          "tuple(%custom-call.1, %all-gather-done)\n}\n")


def test_the_call_inside_the_window():
  ok, why = op_inside_async_window(_module("{start}{call}{done}"), "all-gather-start", TARGET)
  assert ok, why


def test_the_call_before_or_after_the_window():
  for body in ("{call}{start}{done}", "{start}{done}{call}"):
    ok, why = op_inside_async_window(_module(body), "all-gather-start", TARGET)
    assert not ok and "no asynchronous all-gather-start window" in why, why


def test_a_synchronous_collective_has_no_window():
  ok, why = op_inside_async_window(_module("{start}{call}{done}", sync=True), "all-gather-start",
                                   TARGET)
  assert not ok, why


def test_no_collective_or_no_call():
  ok, why = op_inside_async_window(_module("{call}"), "all-gather-start", TARGET)
  assert not ok and why == "no all-gather-start in the program"
  ok, why = op_inside_async_window(_module("{start}{done}").replace(TARGET, "x"),
                                   "all-gather-start", TARGET)
  assert not ok and "no instruction with" in why


def test_a_call_inside_a_command_buffer_is_inlined_where_it_is_called():
  command_buffer = ("%command_buffer (p: bf16[8]) -> bf16[8] {\n"
                    "  %p = bf16[8]{0} parameter(0)\n"
                    "  ROOT %custom-call.1 = bf16[8]{0} custom-call(bf16[8]{0} %p), "
                    + TARGET + "\n"
                    "}\n\n")
  body = ("{start}  %call = bf16[8]{0} call(bf16[8]{0} %p0), to_apply=%command_buffer\n{done}")
  hlo = _module(body, extra=command_buffer).replace("tuple(%custom-call.1", "tuple(%call")
  lines = flat_schedule(hlo)
  assert [i for i, l in enumerate(lines) if "to_apply=%command_buffer" in l][0] + 2 == \
      [i for i, l in enumerate(lines) if TARGET in l][0]
  ok, why = op_inside_async_window(hlo, "all-gather-start", TARGET)
  assert ok, why
