"""A GAN with manual optimization and two Adam optimizers, in the shape of Lightning's example."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.corpus.common import images, loader, trainer

LATENT = 16
PIXELS = 3 * 32 * 32


class GAN(L.LightningModule):
    def __init__(self, planted: bool = False) -> None:
        super().__init__()
        self.planted = planted
        self.automatic_optimization = False
        self.generator = nn.Sequential(
            nn.Linear(LATENT, 64), nn.LeakyReLU(0.2), nn.Linear(64, PIXELS), nn.Tanh()
        )
        self.discriminator = nn.Sequential(nn.Linear(PIXELS, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, z: Tensor) -> Tensor:
        return self.generator(z)

    def noise(self, real: Tensor) -> Tensor:
        if self.planted:
            return torch.randn(real.shape[0], LATENT).type_as(real)  # planted: host-to-device copy
        return torch.randn(real.shape[0], LATENT, device=real.device)

    def training_step(self, batch: Any) -> None:
        real = batch[0].flatten(1)
        optimizer_g, optimizer_d = self.optimizers()  # type: ignore[misc]

        self.toggle_optimizer(optimizer_g)
        fake = self(self.noise(real))
        valid = torch.ones(real.shape[0], 1, device=real.device)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        self.toggle_optimizer(optimizer_d)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), valid)
        fake_loss = F.binary_cross_entropy_with_logits(
            self.discriminator(fake.detach()), torch.zeros_like(valid)
        )
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True)
        self.manual_backward(d_loss)
        optimizer_d.step()
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)
        if self.planted and d_loss.item() > 100:  # planted: scalar read
            raise RuntimeError("the discriminator diverged")

    def configure_optimizers(self) -> Any:
        optimizer_g = torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        optimizer_d = torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999))
        return [optimizer_g, optimizer_d], []


def run(planted: bool, root: str, callbacks: list[L.Callback]) -> None:
    trainer(root, callbacks, limit_val_batches=0).fit(GAN(planted), loader(images(), shuffle=True))
