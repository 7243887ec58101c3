// Cost per driver call from C (no CUDA headers: dlopen libcuda.so.1).
#include <dlfcn.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
typedef int (*f_init)(unsigned);
typedef int (*f_devget)(int*, int);
typedef int (*f_retain)(void**, int);
typedef int (*f_setcur)(void*);
typedef int (*f_getcur)(void**);
typedef int (*f_screate)(void**, unsigned);
typedef int (*f_alloc)(uint64_t*, size_t);
typedef int (*f_memcpy)(uint64_t, uint64_t, size_t, void*);
typedef int (*f_val)(void*, uint64_t, uint64_t, unsigned);
typedef int (*f_ssync)(void*);
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define GET(T,n) T n=(T)dlsym(h,#n "_v2"); if(!n) n=(T)dlsym(h,#n); if(!n){printf("no %s\n",#n);return 1;}
int main(){
  void*h=dlopen("libcuda.so.1",RTLD_NOW); if(!h){printf("no libcuda\n");return 1;}
  GET(f_init,cuInit) GET(f_devget,cuDeviceGet) GET(f_retain,cuDevicePrimaryCtxRetain)
  GET(f_setcur,cuCtxSetCurrent) GET(f_getcur,cuCtxGetCurrent) GET(f_screate,cuStreamCreate)
  GET(f_alloc,cuMemAlloc) GET(f_memcpy,cuMemcpyAsync) GET(f_val,cuStreamWriteValue64)
  GET(f_val,cuStreamWaitValue64) GET(f_ssync,cuStreamSynchronize)
  int d; void*ctx; void*s; uint64_t buf;
  cuInit(0); cuDeviceGet(&d,0); cuDevicePrimaryCtxRetain(&ctx,d); cuCtxSetCurrent(ctx);
  cuStreamCreate(&s,1); cuMemAlloc(&buf,1<<20);
  int n=20000; double t;
  for(int r=0;r<3;r++){
  t=now(); for(int i=0;i<n;i++) cuStreamWriteValue64(s,buf,i,0); cuStreamSynchronize(s);
  printf("C write_value64 %.2f us\n",(now()-t)/n*1e6);
  t=now(); for(int i=0;i<n;i++) cuStreamWaitValue64(s,buf,0,0); cuStreamSynchronize(s);
  printf("C wait_value64(met) %.2f us\n",(now()-t)/n*1e6);
  t=now(); for(int i=0;i<n;i++) cuMemcpyAsync(buf+4096,buf,64,s); cuStreamSynchronize(s);
  printf("C memcpy 64B D2D %.2f us\n",(now()-t)/n*1e6);
  void*c2; t=now(); for(int i=0;i<n;i++){cuCtxGetCurrent(&c2); cuCtxSetCurrent(ctx);} 
  printf("C get+set ctx %.2f us\n",(now()-t)/n*1e6);
  }
  return 0;
}
