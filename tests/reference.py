"""The single-process yardstick the strategy tests compare with: a plain AdamW loop with gradient
clipping on one model, and the objective every layout minimizes (cross-entropy, plus the MoE
load-balance loss, which is defined per microbatch)."""

from typing import Callable

import torch
import torch.nn.functional as F

from tetrad.spec.model import ParallelConfig
from tetrad.models.transformer import Transformer
from tetrad.parallel.comm import Comm
from tetrad.parallel.engine import DataParallelOptions
from tetrad.parallel.mesh import Mesh
from tetrad.parallel.parallelize import ParallelModel, parallelize
from tetrad.train.optim import set_learning_rate


def token_batch(vocab_size: int, rows: int, seq_len: int, step: int) -> torch.Tensor:
    """The same random windows [rows, seq_len + 1] of step `step` on every rank and reference."""
    return torch.randint(vocab_size, (rows, seq_len + 1),
                         generator=torch.Generator().manual_seed(1000 + step))


def seeded_model(config, seed: int) -> Transformer:
    """The same initial model on every rank and reference."""
    torch.manual_seed(seed)
    return Transformer(config)


def objective(model: Transformer, logits: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(cross-entropy, load-balance loss or None for a dense model, what backward is run on)."""
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    aux = model.aux_loss()
    return loss, aux, loss if aux is None else loss + model.config.router_aux_loss_coef * aux


def whole_gradient_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        window: torch.Tensor, lr: float, max_norm: float = 1.0) -> torch.Tensor:
    """One step of a model whose gradients are whole where the optimizer reads them (one
    process, or torch's DDP and FSDP2 peers): cross-entropy on `window` [rows, seq + 1], clipping,
    the optimizer at `lr`. Returns the loss."""
    loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    set_learning_rate(optimizer, lr)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def train_reference(model: Transformer, batch: Callable[[int], torch.Tensor], steps: int,
                    microbatches: int, lr: float, weight_decay: float, max_norm: float) -> dict:
    """Train `model` on batch(step) [rows, seq + 1] for `steps` steps, each batch split into
    `microbatches` accumulated ones. Per step the mean loss and load-balance loss and the gradient
    norm before clipping; the final parameters by name."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses, auxes, norms = [], [], []
    for step in range(steps):
        loss_sum = aux_sum = 0.0
        for window in batch(step).chunk(microbatches):
            loss, aux, total = objective(model, model(window[:, :-1]), window[:, 1:])
            (total / microbatches).backward()
            loss_sum += loss.item() / microbatches
            aux_sum += 0.0 if aux is None else aux.item() / microbatches
        losses.append(loss_sum)
        auxes.append(aux_sum)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "auxes": auxes, "norms": norms,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()}}


def spread(model: Transformer, mesh: Mesh, comm: Comm, parallel: ParallelConfig, seq_len: int
           ) -> ParallelModel:
    """`model` under `parallel` on this rank, by the path training takes (parallelize). The
    strategy tests step their own AdamW over `.params`, as the reference does (no weight-decay
    groups); the engine's optimizer stays unused."""
    return parallelize(model, mesh, comm, parallel, seq_len, DataParallelOptions(
        lambda params: [{"params": list(params.parameters())}], torch.optim.AdamW, (0.9, 0.999),
        1e-8))


def clip_grad_norm(parallel: ParallelModel, max_norm: float) -> float:
    """After parallel.reduce_gradients: the global norm, and the gradients clipped by it."""
    norm = parallel.grad_norm()
    parallel.clip(norm, max_norm)
    return norm
