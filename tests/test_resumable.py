"""One resume mechanism for every training loader (datamodules/resumable.py): the loader's
``state_dict`` is its position in the epoch, in samples; ``load_state_dict`` makes the next
iteration rebuild that epoch's order and start after them, whatever the batch size is now."""
import pytest
import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import Dataset

from datamodules.loaders import make_loader


class Indices(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, index: int) -> int:
        return index


def epoch_order(epoch: int, batch_size: int = 8) -> list[int]:
    loader = make_loader(Indices(), batch_size=batch_size, num_workers=0, train=True, seed=3)
    loader.sampler.set_epoch(epoch)
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_is_the_samples_handed_out_and_a_new_loader_resumes_after_them(workers):
    loader = make_loader(Indices(), batch_size=8, num_workers=workers, train=True, seed=3, persistent_workers=False)
    loader.sampler.set_epoch(1)
    batches = iter(loader)
    seen = [int(i) for _ in range(2) for i in next(batches)]
    state = loader.state_dict()  # what Lightning saves at the end of the second training step
    assert state == {"epoch": 1, "samples": 16, "batch_size": 8}
    assert seen == epoch_order(1)[:16]

    resumed = make_loader(Indices(), batch_size=8, num_workers=workers, train=True, seed=3, persistent_workers=False)
    resumed.load_state_dict(state)
    rest = [int(i) for batch in resumed for i in batch]
    assert rest == epoch_order(1)[16:]
    # the next epoch starts at its beginning
    resumed.sampler.set_epoch(2)
    assert [int(i) for batch in resumed for i in batch] == epoch_order(2)


def test_a_changed_batch_size_resumes_after_the_samples_trained_on():
    """Position 16 (two batches of 8) resumed with batches of 4 and of 16: the next sample is the 17th."""
    state = {"epoch": 1, "samples": 16, "batch_size": 8}
    for batch_size in (4, 16):
        resumed = make_loader(Indices(), batch_size=batch_size, num_workers=0, train=True, seed=3)
        resumed.load_state_dict(state)
        batches = [[int(i) for i in batch] for batch in resumed]
        assert [i for b in batches for i in b] == epoch_order(1)[16:16 + len(batches) * batch_size]
        assert all(len(b) == batch_size for b in batches)
        # and its own position counts in samples of the epoch's order
        assert resumed.state_dict() == {"epoch": 1, "samples": 16 + len(batches) * batch_size,
                                        "batch_size": batch_size}


def test_evaluation_loaders_are_not_stateful():
    """Lightning saves the training loader's state only; an evaluation loader has none to offer."""
    loader = make_loader(Indices(), batch_size=8, num_workers=0, train=False)
    assert not hasattr(loader, "state_dict")
    assert [int(i) for batch in loader for i in batch] == list(range(40))
    assert torch.is_tensor(next(iter(loader)))


def token_loader(max_tokens: int):
    from datamodules.wmt import TokenBatchLoader, TokenBatchSampler

    num_tokens = (torch.arange(60) % 7 + 3).numpy()  # 60 sentences of 3..9 tokens
    sampler = TokenBatchSampler(num_tokens, max_tokens, shuffle=True, seed=5)
    sampler.set_epoch(1)
    return TokenBatchLoader(list(range(60)), batch_sampler=sampler, collate_fn=list)


def test_token_batches_resume_after_the_sentences_trained_on():
    loader = token_loader(40)
    everything = [batch for batch in loader]
    batches = iter(loader)
    seen = [next(batches) for _ in range(3)]
    state = loader.state_dict()
    assert state == {"epoch": 1, "samples": sum(map(len, seen)), "batch_size": 40}

    resumed = token_loader(40)
    resumed.batch_sampler.set_epoch(0)  # the state, not the sampler's epoch, says which epoch is resumed
    resumed.load_state_dict(state)
    assert [batch for batch in resumed] == everything[3:]
    assert resumed.state_dict()["samples"] == sum(map(len, everything))  # the whole epoch, once iterated


def test_token_batches_of_another_max_tokens_skip_as_many_sentences():
    """Other max_tokens pack other batches: the resumed epoch skips the new batches whose sentences
    number no more than those trained on, and counts its position in sentences too."""
    state = {"epoch": 1, "samples": 20, "batch_size": 40}
    resumed = token_loader(80)
    new_batches = [batch for batch in token_loader(80)]
    resumed.load_state_dict(state)
    rest = [batch for batch in resumed]
    skipped = len(new_batches) - len(rest)
    assert rest == new_batches[skipped:]
    assert sum(map(len, new_batches[:skipped])) <= 20 < sum(map(len, new_batches[:skipped + 1]))


class Recorder(LightningModule):
    """Records the sample indices of every training batch it trains on."""

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.trained: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.trained.append([int(i) for i in batch])
        return self.net(batch.float()[:, None]).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class StopAtStep(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 7:
            raise RuntimeError("stopped")


class IndicesData(LightningDataModule):
    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return make_loader(Indices(), batch_size=self.batch_size, num_workers=0, train=True, seed=3,
                           trainer=self.trainer)


def test_fit_resumed_with_a_changed_batch_size_goes_on_after_the_samples_trained_on(tmp_path):
    """Stopped after 2 batches of 8 into the second epoch and resumed with batches of 4: the resumed
    epoch trains on the 17th sample of that epoch's order onwards, each once (Lightning's own position
    is the checkpoint's loader state; no fit-loop counters are read)."""
    def trainer(*callbacks):
        return Trainer(default_root_dir=tmp_path, max_epochs=2, logger=False, enable_progress_bar=False,
                       enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0,
                       callbacks=[*callbacks, ModelCheckpoint(dirpath=tmp_path, save_last=True, every_n_train_steps=1)])

    with pytest.raises(RuntimeError, match="stopped"):
        trainer(StopAtStep()).fit(Recorder(), IndicesData(8))
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 7
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"] == [
        {"epoch": 1, "samples": 16, "batch_size": 8}]

    model = Recorder()
    trainer().fit(model, IndicesData(4), ckpt_path=tmp_path / "last.ckpt")
    assert model.trained[0] == epoch_order(1)[16:20]
    assert [i for batch in model.trained for i in batch] == epoch_order(1)[16:]
