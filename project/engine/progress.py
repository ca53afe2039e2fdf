"""The progress bar: Lightning's tqdm bar, redrawn less often."""

import lightning as L
import torch
from lightning.pytorch.callbacks import TQDMProgressBar


class LossProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar, with the last step's training loss shown beside the logged metrics.

    The module writes the per-step loss straight to the loggers (see ``Classifier._log_step_loss``), so it is not
    among the metrics Lightning's bar collects; the bar reads it from ``training_step``'s output, on the host only
    when it redraws. Redrawing after every batch costs ~0.1 ms of Python, a few percent of a small model's step:
    ``refresh_rate`` (Lightning's own argument) sets how many batches pass between redraws; a loop's last batch is
    always drawn.
    """

    def __init__(self, refresh_rate: int = 10, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)
        self._loss: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self._loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int | str | float]:
        metrics = super().get_metrics(trainer, pl_module)
        if trainer.state.fn == "fit" and isinstance(self._loss, torch.Tensor):  # the last step's, during validation too
            metrics["train/loss"] = f"{self._loss.item():.3g}"
        return metrics
