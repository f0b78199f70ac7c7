"""The single-device step of a small language model, as a trainer defines it: a model of
several inputs (token ids, position ids), batches with labels and the scalar
num_items_in_batch, the summed cross-entropy over num_items_in_batch."""
import torch
from trainprobes.transforms import TrainingStep

VOCAB, SEQ, DIM = 32, 8, 16


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # the same initial weights on every call
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(SEQ, DIM)
        self.mix = torch.nn.Linear(DIM, DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids):
        return self.head(torch.tanh(self.mix(self.tok(input_ids) + self.pos(position_ids))))


def batch(g):
    """8 rows; the first four end after 2 tokens (label -100 after), the rest run to the end."""
    ids = torch.randint(0, VOCAB, (8, SEQ + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:4, 2:] = -100
    return {"input_ids": ids[:, :-1], "position_ids": torch.arange(SEQ).expand(8, SEQ), "labels": labels,
            "num_items_in_batch": (labels != -100).sum()}


def call(model, b):
    return model(b["input_ids"], b["position_ids"])


def loss_sum(logits, b):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                                             reduction="sum")


def loss(logits, b):
    return loss_sum(logits, b) / b["num_items_in_batch"]


def tokens(b):
    return (b["labels"] != -100).sum()


step = TrainingStep(model=TinyLM, batch=batch, loss=loss, call=call, tokens=tokens, name="tinylm")
