#!/usr/bin/env python3
"""A deliberately broken copy of a GGUF model, to show that scripts/fidelity-llama.py's metric catches a model
computed wrongly: llama.cpp answers with the good file, nightshift scores with the broken one (`--nightshift-model`).

    PYTHONPATH=$PEER/gguf-py scripts/break-gguf.py IN.gguf OUT.gguf --rope-base 20000
    PYTHONPATH=$PEER/gguf-py scripts/break-gguf.py IN.gguf OUT.gguf --zero 'attn_q.bias'   # every tensor whose name ends so
    PYTHONPATH=$PEER/gguf-py scripts/break-gguf.py IN.gguf OUT.gguf --set gemma3.attention.sliding_window=64

`--rope-base` replaces `<arch>.rope.freq_base`; `--zero SUFFIX` writes zeros for the tensors whose names end with
SUFFIX (a dropped bias or norm); `--set KEY=NUMBER` sets a numeric key (added as a float32 if the file lacks it;
a soft-cap of 1e9 is none, a window as long as the context is full attention), `--set KEY=false` (or `true`) a
boolean one (`llama.expert_weights_norm=false`: the chosen experts' weights not renormalized). Everything else is
copied as it is.
"""
import argparse

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--rope-base", type=float)
    ap.add_argument("--zero", action="append", default=[])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=NUMBER|true|false")
    args = ap.parse_args()
    # `true` and `false` set a boolean key (a flag such as `expert_weights_norm`), anything else a number.
    def value_of(text):
        return {"true": True, "false": False}[text] if text in ("true", "false") else float(text)

    sets = {k: value_of(v) for k, v in (item.split("=", 1) for item in args.set)}

    reader = GGUFReader(args.input)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(args.output, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == f"{arch}.rope.freq_base" and args.rope_base is not None:
            value = args.rope_base
        vtype = field.types[0]
        if key in sets:
            value = sets.pop(key)
            value = int(value) if vtype in (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64) else value
        if vtype == GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
    for key, value in sets.items():
        writer.add_key_value(key, value, GGUFValueType.BOOL if isinstance(value, bool) else GGUFValueType.FLOAT32)
    for tensor in reader.tensors:
        data = tensor.data
        if any(tensor.name.endswith(suffix) for suffix in args.zero):
            data = np.zeros_like(data)
        writer.add_tensor(tensor.name, data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    main()
