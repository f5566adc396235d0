import pytest
import timm
import torch

from backbones import MobileViTv2
from tasks.classify import ClassificationTask


@pytest.fixture(scope="module")
def timm_checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    reference = timm.create_model("mobilevitv2_050", pretrained=False).eval()
    path = tmp_path_factory.mktemp("weights") / "mobilevitv2_050_timm.pth"
    torch.save(reference.state_dict(), path)
    return reference, path


def test_whole_classifier_import_reproduces_timm_logits(timm_checkpoint):
    reference, path = timm_checkpoint
    task = ClassificationTask(MobileViTv2(width=0.5), class_names=[str(i) for i in range(1000)], weights=str(path))
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        assert (task.eval()(x) - reference(x)).abs().max() <= 1e-5


def test_other_class_count_keeps_backbone_and_drops_classifier(timm_checkpoint):
    reference, path = timm_checkpoint
    with pytest.warns(UserWarning, match="1000 classes, the model 10"):
        task = ClassificationTask(MobileViTv2(width=0.5), class_names=list("abcdefghij"), weights=str(path))
    x = torch.rand(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(task.eval().backbone.forward_pooled(x), reference.forward_head(
            reference.forward_features(x), pre_logits=True), atol=1e-5, rtol=0)
    assert task.head.fc.out_features == 10


def test_checkpoint_for_another_backbone_is_refused_with_key_lists(timm_checkpoint):
    _, path = timm_checkpoint
    with pytest.raises(Exception, match="does not fit MobileViTv2"):
        ClassificationTask(MobileViTv2(width=1.0), class_names=["a", "b"], weights=str(path))
