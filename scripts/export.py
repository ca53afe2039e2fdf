"""Export a checkpoint's model: python scripts/export.py CKPT --format safetensors|onnx|pt2|pth|all --out DIR

Writes DIR/model.<format> of the run's LightningModule itself (rebuilt from the run's config.yaml, so run it from
the project folder), and DIR/model.onnx.data when the ONNX exporter keeps the weights beside the graph (keep the two
together). Load them:
  safetensors: from lightkeep import load_net; model = load_net("DIR/model.safetensors")
  onnx:        onnxruntime.InferenceSession("DIR/model.onnx").run(None, {"input": x.numpy()})[0]
               (a forward of several inputs: each named as forward's parameter)
  pt2:         torch.export.load("DIR/model.pt2").module()(x)
  pth:         model = build(json.load(open("DIR/model.json"))); model.load_state_dict(torch.load("DIR/model.pth"))
               (build from lightkeep.export.weights)
"""

import argparse

import torch

from lightkeep.export.formats import FORMATS, export

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
        help="one sample's shape for tracing onnx/pt2, e.g. 1,8,8 (float32); default: the module's example_input_array,"
        " else what its own predict_step (else validation_step, else training_step) calls forward with on two "
        "samples of the run's data",
    )
    parser.add_argument(
        "--config",
        help="a config naming model: (and data:) for a checkpoint outside a run folder, e.g. one plain Lightning "
        "wrote; default: the run's config.yaml",
    )
    args = parser.parse_args()
    try:
        example = torch.rand(2, *map(int, args.input_shape.split(","))) if args.input_shape else None
        formats = FORMATS if args.format == "all" else (args.format,)
        for path in export(args.ckpt, args.out, formats, example, config_path=args.config):
            print(f"wrote {path}")
    except (ValueError, OSError) as error:  # not a checkpoint, not exportable, output exists: one line, exit 2
        parser.error(str(error))
