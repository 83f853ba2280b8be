"""Weight offload: pinned host slabs, copy engines, block/phase streaming, disk reader, model offload.

See ARCHITECTURE §4. Typical block/phase streaming setup (storage "cpu"):

    units = plan_units(model, "phase", Family.STREAM_SPEC)      # model built on meta
    kept, units = split_resident(units, resident_blocks)        # offload.resident_blocks: kept units load as resident
    load the `resident_names(model, units)` tensors onto the device yourself
    source = HostSource(units, state_dict, dtype, weight_dtype, pin_memory, consume=True)  # state_dict emptied
    streamer = BlockStreamer(model, units, source, device, gpu_slots, prefetch_depth)
    ... forward passes ...; streamer.reset() at each request boundary; streamer.close()
"""

from runnerkit.offload.disk import (
    CheckpointChangedError,
    FileIdentity,
    SafetensorsDiskReader,
    TensorIndexEntry,
    read_header,
)
from runnerkit.offload.layout import (
                                      FP8_E4M3_MAX,
                                      StreamSpec,
                                      StreamUnit,
                                      TensorPlacement,
                                      UnitLayout,
                                      dequantize_fp8_e4m3,
                                      host_fill_peak,
                                      plan_unit_layout,
                                      plan_units,
                                      quantize_fp8_e4m3,
                                      resident_names,
                                      split_resident,
)
from runnerkit.offload.model_offload import ModelOffloader
from runnerkit.offload.pinned import ALIGNMENT, HostSlab, align_up, plan_offsets, typed_view
from runnerkit.offload.sources import DiskSource, HostSource, UnitSource
from runnerkit.offload.streamer import BlockStreamer
from runnerkit.offload.streams import CopyEngine, CudaCopyEngine, SyncCopyEngine, make_copy_engine

__all__ = [
    "ALIGNMENT", "FP8_E4M3_MAX", "BlockStreamer", "CheckpointChangedError", "CopyEngine", "CudaCopyEngine", "DiskSource",
    "FileIdentity", "HostSlab", "HostSource", "ModelOffloader", "SafetensorsDiskReader", "StreamSpec", "StreamUnit", "SyncCopyEngine",
    "TensorIndexEntry", "TensorPlacement", "UnitLayout", "UnitSource", "align_up", "dequantize_fp8_e4m3", "host_fill_peak",
    "make_copy_engine", "plan_offsets", "plan_unit_layout", "plan_units", "quantize_fp8_e4m3", "read_header",
    "resident_names", "split_resident", "typed_view",
]
