"""Export a checkpoint's network: python scripts/export.py CKPT --format safetensors|onnx|pt2|pth|all --out DIR

Writes DIR/model.<format>. Run it from the project folder (the run's config names the net by its class_path).
Load them without Lightning:
  safetensors: from project.engine.weights import load_net; net = load_net("DIR/model.safetensors")
  onnx:        onnxruntime.InferenceSession("DIR/model.onnx").run(None, {"input": x.numpy()})[0]
  pt2:         torch.export.load("DIR/model.pt2").module()(x)
  pth:         net = MLP(**init_args); net.load_state_dict(torch.load("DIR/model.pth", weights_only=True))
"""

import argparse

import torch

from project.engine.export import FORMATS, export

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "ckpt",
        help="a Lightning checkpoint (a file, or a sharded folder), e.g. runs/digits/version_0/checkpoints/last.ckpt",
    )
    parser.add_argument("--format", default="all", choices=[*FORMATS, "all"], help="what to write (default: all)")
    parser.add_argument("--out", required=True, help="the folder to write into; existing files are never replaced")
    parser.add_argument(
        "--input_shape",
        help="one sample's shape for tracing onnx/pt2, e.g. 1,8,8 (float32); default: two samples of the run's data",
    )
    args = parser.parse_args()
    try:
        example = torch.rand(2, *map(int, args.input_shape.split(","))) if args.input_shape else None
        for path in export(args.ckpt, args.out, FORMATS if args.format == "all" else (args.format,), example):
            print(f"wrote {path}")
    except (ValueError, OSError) as error:  # not a checkpoint, not exportable, output exists: one line, exit 2
        parser.error(str(error))
