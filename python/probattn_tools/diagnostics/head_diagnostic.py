import sys, json, time, torch, torch.nn.functional as F
from probattn_tools.baselines.vqa import VqaModel
from safetensors.torch import load_file
torch.set_num_threads(1); torch.manual_seed(0)
D=sys.argv[6]
import glob
d=load_file(D+'/data.safetensors'); f=load_file(glob.glob(D+'/features/*.safetensors')[0])
views=[f[f'view{i}'] for i in range(3)]
meta=json.load(open(D+'/meta.json'))
lr=float(sys.argv[1]); layers=int(sys.argv[2]); bs=int(sys.argv[3]); n=int(sys.argv[4])
tr={k:d['train_'+k][:n] for k in ('image','tokens','answer')}
va={k:d['val_'+k][:3000] for k in ('image','tokens','answer','type')}
m=VqaModel(3,64,'softmax',len(meta['vocab']),12,layers=layers)
opt=torch.optim.Adam(m.parameters(),lr)
step=0; t0=time.time()
for ep in range(100):
  m.train(); order=torch.randperm(len(tr['answer']))
  for i in range(0,len(order),bs):
    idx=order[i:i+bs]; img=tr['image'][idx]
    loss=F.cross_entropy(m(*(v[img] for v in views),tr['tokens'][idx]),tr['answer'][idx])
    opt.zero_grad(); loss.backward(); opt.step(); step+=1
    if step%500==0:
      m.eval()
      with torch.no_grad():
        img=va['image']; hit=(m(*(v[img] for v in views),va['tokens']).argmax(-1)==va['answer']).float()
      per=[hit[va['type']==t].mean().item() for t in range(6)]
      print(step, round(time.time()-t0), round(hit.mean().item(),3), [round(x,2) for x in per], flush=True)
      m.train()
      if time.time()-t0>float(sys.argv[5]): sys.exit()
