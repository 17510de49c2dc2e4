"""The pipeline workers' small network: four Linears, a skip connection across the stage boundary (before ``l3``)."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16)
        self.l3, self.l4 = torch.nn.Linear(16, 16), torch.nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.l2(torch.relu(self.l1(x))))
        if hasattr(self, "print"):  # the r2.3 sample prints inside its network (ops.Print)
            self.print("h is:", h)
        return self.l4(torch.relu(self.l3(h)) + h)  # a skip connection across the stage boundary
