"""The tiny Llama of `llama.py` as a Lightning module, for the Lightning callback tests; importing this module
needs lightning and transformers (``pytest.importorskip`` both first)."""

from __future__ import annotations

import lightning as L
import torch

from tests.trainer.integrations.llama import BATCH, SEQ, tiny_llama

__all__ = ["BATCH", "SEQ", "TinyLlama"]


class TinyLlama(L.LightningModule):
    def __init__(self, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.model = tiny_llama()
        self.losses: list[torch.Tensor] = []  # every micro-batch's loss, as training_step returned it

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.losses.append(loss.detach().clone())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
