"""Export a checkpoint's bare network weights: python scripts/export_weights.py CKPT OUT.pth

Load them without Lightning: net = MLP(**init_args); net.load_state_dict(torch.load(OUT, weights_only=True)).
"""

import argparse

from project.engine.export import export_weights

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ckpt", help="a Lightning checkpoint, e.g. runs/digits/version_0/checkpoints/last.ckpt")
    parser.add_argument("out", help="where to write the state_dict (.pth); a .json with the net's config goes beside")
    args = parser.parse_args()
    try:
        print(f"wrote {export_weights(args.ckpt, args.out)}")
    except (ValueError, OSError) as error:  # not a checkpoint, unsafe to load, output exists: one line, exit 2
        parser.error(str(error))
