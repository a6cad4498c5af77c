"""``captioner demo``: synthetic scenes -> three decoders trained on a budget -> one HTML report."""

from __future__ import annotations

import argparse

from captioner.commands.options import MAX_BEAM, float_range, int_range

NAME = "demo"
HELP = ("generate synthetic scenes, train SAT-soft, SAT-hard and the Transformer on a time budget, "
        "and write a comparison report with attention overlays")
EXAMPLES = """
  captioner demo                                    # under 5 minutes on a 2-core CPU; open runs/demo/report.html
  captioner demo --quick                            # a 1-minute smoke run (small data, short budgets)
  captioner demo --decoders sat_soft,transformer --budget sat_soft=180,transformer=60
  captioner demo --data data/shapes --images 4000 --seed 1 --out runs/demo_seed1
  captioner demo --scst                             # + a self-critical stage per decoder (rows sat_soft+scst, ...)
  captioner demo --scst --scst-budget 60            # ... of 60 s each (default: the decoder's own budget)
  captioner demo --no-attention-supervision         # without the box supervision of the attention, to compare
  captioner demo --unseen-pairs 4 --out runs/demo_unseen4   # 4 colour-shape pairs seen only in test
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=None,
                        help="synthetic-scenes folder; generated when absent (default: data/shapes, "
                             "or data/shapes_unseen<K> with --unseen-pairs K)")
    parser.add_argument("--images", type=int_range(30, 10_000_000), default=None,
                        help="scenes to generate when the folder is absent (default: 3000; --quick: 400)")
    parser.add_argument("--seed", type=int_range(0, 2**63 - 1), default=0, help="seed of the scenes and of training (default: 0)")
    parser.add_argument("--budget", default=None,
                        help="training seconds: one number for every decoder, or decoder=seconds pairs "
                             "(default: sat_soft=120,sat_hard=120,transformer=45; --quick: 15 each)")
    parser.add_argument("--encoder-budget", type=float_range(0, 10**7, low_open=True), default=None,
                        help="seconds of word-detector pretraining of the shared CNN (default: 60; --quick: 10)")
    parser.add_argument("--jobs", type=int_range(1, 256), default=None,
                        help="decoders trained at the same time, one process each (default: one per core on "
                             "CPU, 1 on GPU)")
    parser.add_argument("--decoders", default="sat_soft,sat_hard,transformer",
                        help="comma-separated decoders to train (default: sat_soft,sat_hard,transformer)")
    parser.add_argument("--out", default="runs/demo", help="output folder for runs and the report (default: runs/demo)")
    parser.add_argument("--force", action="store_true",
                        help="replace a report.html or report.json in --out that captioner did not write")
    parser.add_argument("--overlays", type=int_range(0, 1000), default=4, help="test images shown with overlays per decoder (default: 4)")
    parser.add_argument("--beam", type=int_range(1, MAX_BEAM), default=None, help="beam size for the test captions (default: 3, as everywhere)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto (default: cpu)")
    parser.add_argument("--quick", action="store_true", help="tiny run: fewer scenes, short budgets, small models")
    parser.add_argument("--scst", action="store_true",
                        help="after each decoder's budget, a self-critical (SCST) stage from its best checkpoint")
    parser.add_argument("--scst-budget", default=None,
                        help="seconds of each SCST stage: one number or decoder=seconds pairs "
                             "(default: the decoder's own --budget)")


    parser.add_argument("--no-attention-supervision", action="store_true",
                        help="train without attention supervised by the object boxes (for comparison)")
    parser.add_argument("--encoder-from-captions", action="store_true",
                        help="pretrain the CNN's word detectors from the captions alone (no boxes, no recoloured "
                             "images), for comparison")
    parser.add_argument("--unseen-pairs", type=int_range(0, 18), default=0, metavar="K",
                        help="compositional split: K colour-shape pairs only in test (scenes in "
                             "data/shapes_unseen<K> unless --data); the table adds objects right for seen and "
                             "unseen pairs")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from captioner.demo.pipeline import DemoOptions, run_demo
    from captioner.demo.report import format_table
    from captioner.files import Outputs

    data = args.data or ("data/shapes" if not args.unseen_pairs else f"data/shapes_unseen{args.unseen_pairs}")
    options = DemoOptions.from_args(
        data=data, images=args.images, seed=args.seed, budget=args.budget, decoders=args.decoders,
        out=args.out, overlays=args.overlays, beam_size=args.beam, device=args.device, quick=args.quick,
        encoder_budget=args.encoder_budget, jobs=args.jobs, scst=args.scst, scst_budget=args.scst_budget,
        attention_supervision=not args.no_attention_supervision, unseen_pairs=args.unseen_pairs,
        encoder_boxes=not args.encoder_from_captions,
    )
    outputs = Outputs(Path(args.out), force=args.force, option="--out")  # an earlier demo's report is replaced
    outputs.check([Path(args.out) / "report.html", Path(args.out) / "report.json"])  # a user's is not
    report = run_demo(options)
    outputs.record([report["paths"]["html"], report["paths"]["json"]])
    print()
    print(format_table(report["table"]))
    print()
    for note in report.get("pace", []):
        print(f"warning: {note}")
    print(f"report: {report['paths']['html']}")
    print(f"        {report['paths']['json']}")
    print(f"total time {report['seconds']:.0f} s")
    return 0
